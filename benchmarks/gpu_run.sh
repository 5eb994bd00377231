#!/usr/bin/env bash
# The one command of a session lent a GPU (the device tool's `run`, from the repository root):
# the CUDA tests of the attention kernels, the chunked loss, the executor, then compiled blocks, then every part of
# benchmarks/bench_gpu.py; logs and results under $OUT (bench_gpu.md is printed last).
#
#   run(command="bash benchmarks/gpu_run.sh", timeout_s=570)
#
# Nothing to install: the image's python3 has torch, numpy, numba, pyarrow, xxhash, jinja2 and
# pytest; the data layer's streaming libraries are not needed (batches are made in memory).
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
