#!/usr/bin/env bash
# The one command of a session lent a GPU (the device tool's `run`, from the repository root):
# the CUDA tests of the attention kernels, the chunked loss, the executor, then compiled blocks, then every part of
# benchmarks/bench_gpu.py; logs and results under $OUT (bench_gpu.md is printed last).
#
#   bash benchmarks/torchtitan_wheels.sh      # here first: TorchTitan's wheels into .whl/
#   run(command="bash benchmarks/gpu_run.sh", carry=[".whl"], timeout_s=570)
#
# The image's python3 has torch, numpy, numba, pyarrow, xxhash, jinja2 and pytest; the data
# layer's streaming libraries are not needed (batches are made in memory). Only TorchTitan (the
# `torchtitan` part, skipped without it) is installed, from the carried .whl/, into /tmp/site.
# PARTS=name,name runs only those parts of bench_gpu.py, without the tests (a second call).
# Dry run of the same logic on a CPU: tests/test_bench_gpu.py.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mixlen-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=8
PY=${PY:-python3}
BUDGET=${BUDGET:-330}  # seconds the longest-document search may still start probes within
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$OUT/gpu.txt"
if ls .whl/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site" || echo "TorchTitan's wheels: not installed"
fi
if [ -n "${PARTS:-}" ]; then
  timeout 500 $PY benchmarks/bench_gpu.py --out "$OUT" --parts "$PARTS" --budget-s "$BUDGET" \
    > "$OUT/bench.log" 2>&1
  status=$?
  cat "$OUT/bench_gpu.md" 2>/dev/null || tail -40 "$OUT/bench.log"
  exit $status
fi
echo "== CUDA tests"
timeout 180 $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/test_attention_kernels.py \
  tests/test_attention.py tests/test_loss.py tests/test_executor.py -k "cuda or chunked or model_loss" \
  2>&1 | tee "$OUT/pytest.log" | tail -15
# inductor's first compile of a block may take a minute: apart, so it cannot cut the tests above
timeout 90 $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/test_compile.py -k cuda \
  2>&1 | tee "$OUT/pytest_compile.log" | tail -5
echo "== bench_gpu"
timeout 400 $PY benchmarks/bench_gpu.py --out "$OUT" --budget-s "$BUDGET" > "$OUT/bench.log" 2>&1
status=$?
grep -E "done in" "$OUT/bench.log"
cat "$OUT/bench_gpu.md" 2>/dev/null || tail -40 "$OUT/bench.log"
exit $status
