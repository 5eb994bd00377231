#!/usr/bin/env bash
# The one command of a session lent a GPU (the device tool's `run`, from the repository root):
# the CUDA tests of the attention kernels, the chunked loss, the executor, then compiled blocks, then every part of
# benchmarks/bench_gpu.py in what is left of one deadline; results under $OUT (bench_gpu.md is printed last).
#
#   bash benchmarks/torchtitan_wheels.sh      # here first: TorchTitan's wheels into .whl/
#   run(command="bash benchmarks/gpu_run.sh", carry=[".whl"], timeout_s=570)
#
# The image's python3 has torch, numpy, numba, pyarrow, xxhash, jinja2 and pytest; the data
# layer's streaming libraries are not needed (batches are made in memory). Only TorchTitan (the
# `torchtitan` part, skipped without it) is installed, from the carried .whl/, into /tmp/site.
# PARTS=name,name runs only those parts of bench_gpu.py, without the tests unless TESTS=1 (a
# second call); COMPILE_TEST=0 leaves the compiled-block test out; END=seconds moves the deadline
# (default 545, inside the run's timeout of 570). A session that splits its device time in two:
#   run(command="TESTS=1 COMPILE_TEST=0 PARTS=check,attention,calibrate,train,ring,checkpoint
#       END=300 bash benchmarks/gpu_run.sh", carry=[".whl"], timeout_s=320)
#   run(command="TESTS=0 PARTS=torchtitan,longest,compiled,reference END=... bash ...", ...)
# Dry run of the same logic on a CPU: tests/test_bench_gpu.py; of this script, DRY=1 (tiny sizes).
# What the next session lent a GPU runs (issue 37's open goal, compiled mixlen >= the reference loop
# at 32K; about 400 s on an H200 by the parts' times on 2026-11-30), in one call:
#   run(command="TESTS=1 PARTS=compiled,reference,gap,train,torchtitan,losschunk,profile END=545
#       bash benchmarks/gpu_run.sh", carry=[".whl"], timeout_s=570)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mixlen-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=8
PY=${PY:-python3}
END=${END:-545}  # seconds after this script starts by which everything has ended (run's 570)
cap() { local left=$((END - SECONDS)); echo $(($1 < left ? $1 : (left > 5 ? left : 5))); }
# $OUT holds at most 8 files that come back: gpu.txt, pytest.log, bench.log, bench_gpu.json,
# bench_gpu.md, cost-gpu.json
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$OUT/gpu.txt"
if ls .whl/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site" || echo "TorchTitan's wheels: not installed"
fi
bench() {  # bench_gpu.py within what is left, its tables printed whatever happened
  local budget=$((END - SECONDS - 20))
  timeout $((budget + 15)) $PY benchmarks/bench_gpu.py --out "$OUT" --budget-s "$budget" \
    ${DRY:+--dry-run} "$@" \
    > "$OUT/bench.log" 2>&1
  local status=$?
  grep -E "done in" "$OUT/bench.log"
  cat "$OUT/bench_gpu.md" 2>/dev/null || tail -40 "$OUT/bench.log"
  return $status
}
if [ -n "${PARTS:-}" ] && [ "${TESTS:-0}" != 1 ]; then
  bench --parts "$PARTS"
  exit $?
fi
echo "== CUDA tests"
# the tests that need CUDA (they skip on a CPU): kernels, ring, executor, chunked loss, offload
timeout "$(cap 90)" $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/test_attention_kernels.py \
  tests/test_attention.py tests/test_loss.py tests/test_executor.py tests/test_offload.py \
  -k "test_cuda_kernels or test_cuda_ring or test_attend_cuda or test_exactness_threads_cuda or test_chunked_loss_cuda or test_cuda_offload" \
  2>&1 | tee "$OUT/pytest.log" | tail -15
tests=$?
# inductor's first compile of a block may take a minute: apart, so it cannot cut the tests above
compiled=0
if [ "${COMPILE_TEST:-1}" = 1 ]; then
  timeout "$(cap 60)" $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/test_compile.py \
    -k "test_compiled_blocks_on_cuda" 2>&1 | tee -a "$OUT/pytest.log" | tail -5
  compiled=$?
fi
echo "== bench_gpu"
bench ${PARTS:+--parts "$PARTS"}
status=$?
echo "exit: tests $tests, compile test $compiled, bench $status"
exit $((tests | compiled | status))
