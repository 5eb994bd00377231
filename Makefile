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

.PHONY: install demo demo-data demo-train test lint format bench clean

install: $(STAMP)-$(HASH)

$(STAMP)-$(HASH):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[dev]'
	rm -f $(STAMP)-*
	touch $@

# preprocess the standard library (BPE tokens), profile it, calibrate the cost model of the demo's
# model on this machine,
# plan its first steps, train `debug` on 4 ranks comparing hdp+widen with the static mesh
demo: demo-data demo-train

DEMO_PLAN := --ranks 4 --capacity 8192 --global-batch-tokens 32768

demo-data: install
	$(VENV)/bin/mixlen preprocess "$(STDLIB)" --glob '**/*.py' --exclude 'site-packages/*' \
		--tokenizer tests/assets/bpe-stdlib.json --workers 2 --max-len 16384 \
		--out $(DEMO_DIR)/stdlib --overwrite
	$(VENV)/bin/mixlen profile $(DEMO_DIR)/stdlib --capacity 8192 --plot $(DEMO_DIR)/stdlib-lengths.png
	$(VENV)/bin/mixlen calibrate configs/demo.toml --nproc 4 --clock cpu --repeats 1 \
		--lengths 256,1024,2048,4096 --ring-lengths 1024,4096 --ring-sizes 2,4 \
		--packs 8x256,2x1024,4x1024,2x2048,32x256 --min-seconds 1 \
		--out $(DEMO_DIR)/cost.json
	$(VENV)/bin/mixlen plan $(DEMO_DIR)/stdlib $(DEMO_PLAN) --policy all --widen --steps 8 \
		--cost $(DEMO_DIR)/cost.json --html $(DEMO_DIR)/plan.html

demo-train: install
	test -f $(DEMO_DIR)/stdlib/index.parquet -a -f $(DEMO_DIR)/cost.json || $(MAKE) demo-data
	$(VENV)/bin/mixlen train configs/demo.toml --nproc 4 \
		--set data.path='"$(DEMO_DIR)/stdlib"' --set metrics.dir='"$(DEMO_DIR)/run"' \
		--set checkpoint.dir='"$(DEMO_DIR)/run/ckpt"' --set parallel.cost='"$(DEMO_DIR)/cost.json"'
	@echo "plan report (4 ranks: hdp, hdp+widen, static, naive-hdp): $(DEMO_DIR)/plan.html"

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
