# mixlen: `make demo` and `make test` bootstrap .venv on a fresh machine, then do their job.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONSTRAINTS := constraints.txt
STAMP := $(VENV)/.install-stamp
# the install is redone only when pyproject.toml or the constraints change
HASH := $(shell cat pyproject.toml $(CONSTRAINTS) | sha256sum | cut -c1-16)
DEMO_DIR ?= .demo
STDLIB := $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test lint format bench clean

install: $(STAMP)-$(HASH)

$(STAMP)-$(HASH):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[dev]'
	rm -f $(STAMP)-*
	touch $@

demo: install
	$(VENV)/bin/mixlen preprocess "$(STDLIB)" --glob '**/*.py' --exclude 'site-packages/*' \
		--max-len 16384 --out $(DEMO_DIR)/stdlib --overwrite
	$(VENV)/bin/mixlen profile $(DEMO_DIR)/stdlib --capacity 4096 --plot $(DEMO_DIR)/stdlib-lengths.png

test: install
	$(PY) -m pytest -q -p no:cacheprovider tests

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: install
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[dev,bench]'
	$(PY) benchmarks/bench_ingest.py

clean:
	rm -rf $(DEMO_DIR) benchmarks/out
