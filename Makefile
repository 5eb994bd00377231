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
# compiled bytecode is kept (__pycache__, git-ignored) even where the environment says not to: the
# tests and the demo start dozens of interpreters (ranks, the command line), each of which would
# otherwise compile the project's modules again (~50 s of CPU over `make test` on 2 cores)
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo demo-data demo-train demo-extend test lint format bench clean

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
	rm -rf $(DEMO_DIR)/run  # a new run each time (a run refuses a directory of earlier checkpoints)
	$(VENV)/bin/mixlen train configs/demo.toml --nproc 4 \
		--set data.path='"$(DEMO_DIR)/stdlib"' --set metrics.dir='"$(DEMO_DIR)/run"' \
		--set checkpoint.dir='"$(DEMO_DIR)/run/ckpt"' --set parallel.cost='"$(DEMO_DIR)/cost.json"'
	@echo "plan report (4 ranks: hdp, hdp+widen, static, naive-hdp): $(DEMO_DIR)/plan.html"

# context extension on this CPU (configs/extend-demo.toml): the debug model trained on short
# documents, exported, continued with RoPE scaling on a mixture with long documents and a context
# stage, evaluated before and after (loss by position, passkey by length)
EXTEND := $(DEMO_DIR)/extend
BPE := --tokenizer tests/assets/bpe-stdlib.json --workers 2 --format parquet --overwrite
EXTEND_EVAL := --val-fraction 0.02 --max-tokens 32768 --capacity 4096 --nproc 2 --passkey-depths 0,0.5,1
SHORT_RUN := --set data.path='"$(EXTEND)/short"' --set train.steps=40 \
	--set train.global_batch_tokens=16384 --set train.eval_interval=0 --set train.warmup=4 \
	--set parallel.capacity=4096 --set model.max_position_embeddings=1024 \
	--set checkpoint.dir='"$(EXTEND)/short-run/ckpt"' --set checkpoint.interval=40 \
	--set metrics.dir='"$(EXTEND)/short-run"'

demo-extend: install
	$(VENV)/bin/mixlen preprocess "$(STDLIB)" --glob '*.py' --max-len 1024 $(BPE) --out $(EXTEND)/short
	$(VENV)/bin/mixlen preprocess "$(STDLIB)" --glob '*/**/*.py' --exclude 'site-packages/*' \
		--exclude 'test/*' --exclude '*/test/*' --exclude '*/tests/*' --exclude '*/idle_test/*' \
		--max-len 4096 --min-tokens 2048 $(BPE) --out $(EXTEND)/long
	rm -rf $(EXTEND)/short-run $(EXTEND)/long-run $(EXTEND)/eval-before $(EXTEND)/eval-after
	$(VENV)/bin/mixlen train configs/debug.toml --nproc 2 $(SHORT_RUN)
	$(VENV)/bin/mixlen export $(EXTEND)/short-run/ckpt --hf $(EXTEND)/short-hf --overwrite
	$(VENV)/bin/mixlen eval $(EXTEND)/short-hf $(EXTEND)/long $(EXTEND_EVAL) \
		--passkey-lengths 1024,2048,4096 --passkey-beyond-context --out $(EXTEND)/eval-before
	$(VENV)/bin/mixlen train configs/extend-demo.toml --nproc 2
	$(VENV)/bin/mixlen export $(EXTEND)/long-run/ckpt --hf $(EXTEND)/long-hf --overwrite
	$(VENV)/bin/mixlen eval $(EXTEND)/long-hf $(EXTEND)/long $(EXTEND_EVAL) \
		--passkey-lengths 1024,2048,4096 --out $(EXTEND)/eval-after
	$(PY) benchmarks/extend_report.py $(EXTEND)/eval-before/eval.json \
		$(EXTEND)/eval-after/eval.json --out $(EXTEND)/report.json

# supervised fine-tuning with loss masks on this CPU (configs/sft-demo.toml): conversations about
# the standard library's functions (the module's source as context, the docstring as the answer),
# the demo's model fine-tuned on them with the mask and, beside it at the same time, on the same
# conversations flattened into text; both validate on held-out modules' answers
SFT := $(DEMO_DIR)/sft
SFT_PRE := --tokenizer tests/assets/bpe-stdlib.json \
	--chat-template tests/assets/chat_templates/demo-bpe.jinja --overwrite --quiet
SFT_RUN = $(VENV)/bin/mixlen train configs/sft-demo.toml --set data.val_path='"$(SFT)/val"' \
	--set data.path='"$(SFT)/$(1)"' --set metrics.dir='"$(SFT)/$(2)"' \
	--set checkpoint.dir='"$(SFT)/$(2)/ckpt"'

.PHONY: demo-sft
demo-sft: install
	$(PY) benchmarks/sft_demo.py data "$(STDLIB)" --out $(SFT)/rows
	$(VENV)/bin/mixlen preprocess $(SFT)/rows/train.jsonl $(SFT_PRE) --out $(SFT)/train
	$(VENV)/bin/mixlen preprocess $(SFT)/rows/flat.jsonl $(SFT_PRE) --out $(SFT)/flat
	$(VENV)/bin/mixlen preprocess $(SFT)/rows/val.jsonl $(SFT_PRE) --out $(SFT)/val
	$(VENV)/bin/mixlen profile $(SFT)/train
	rm -rf $(SFT)/masked $(SFT)/flat-run
	$(call SFT_RUN,flat,flat-run) > $(SFT)/flat-run.log 2>&1 & pid=$$!; \
		$(call SFT_RUN,train,masked); wait $$pid || (tail -20 $(SFT)/flat-run.log; exit 1)
	$(PY) benchmarks/sft_demo.py report $(SFT)/masked/metrics.jsonl \
		$(SFT)/flat-run/metrics.jsonl --out $(SFT)/report.md

# the suite on TEST_WORKERS pytest-xdist workers, one test file at a time each (module fixtures
# such as spawned ranks or a Ray runtime are set up once), in tests/conftest.py's order (files
# with slow tests first) rather than xdist's (most tests first); `serial` tests run alone. The
# numba kernels are compiled once (datapipe.plan.warm, started by the controller while the workers
# collect; no test starts before it ends), not by each spawned rank at once.
TEST_WORKERS ?= 2

test: install
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder --durations=20 tests

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: install
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[dev,bench]'
	$(PY) benchmarks/bench_ingest.py

# numba's on-disk kernel cache is dropped too (datapipe.jit already recompiles every kernel when
# any kernel module changes; this frees the disk)
clean:
	rm -rf $(DEMO_DIR) benchmarks/out
	find datapipe -name '*.nbi' -delete -o -name '*.nbc' -delete
