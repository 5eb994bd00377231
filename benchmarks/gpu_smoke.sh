#!/usr/bin/env bash
# GPU smoke test of the trainer's CUDA paths, which cannot run on the CPU-only dev box:
# NCCL with eager device_id initialisation and batched P2P ring hops, flash-attn varlen (if
# installed), bfloat16 compute with float32 master weights, activation offload on side streams.
#
#   bash benchmarks/gpu_smoke.sh            # on a machine with >= 2 GPUs (uses all of them)
#   PY=python3 bash benchmarks/gpu_smoke.sh # no .venv: mixlen runs as `python3 -m tools.cli`
#
# Needs `make demo` (the .demo/stdlib dataset) or DATA=<preprocessed dataset dir>.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DATA=${DATA:-.demo/stdlib}
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -lt 1 ]; then echo "gpu_smoke: no CUDA device" >&2; exit 1; fi
if [ "$NGPU" -lt 2 ]; then echo "gpu_smoke: 1 GPU: NCCL rings and P2P are not exercised (need >= 2)" >&2; fi
MIXBIN="$(dirname "$PY")/mixlen"
mixlen() { if [ -x "$MIXBIN" ]; then "$MIXBIN" "$@"; else "$PY" -m tools.cli "$@"; fi; }
CAP=$((16384 / NGPU > 2048 ? 16384 / NGPU : 2048))  # NGPU ranks x CAP hold a 16K sample
$PY -c "import flash_attn" 2>/dev/null && echo "flash-attn: installed" || echo "flash-attn: not installed (math backend)"
RUN=$(mktemp -d)
FAILED=()
check() { "$@" || { echo "gpu_smoke: FAILED: $*" >&2; FAILED+=("$*"); }; }  # go on, report at the end
echo "== CUDA tests (attention against the naive reference; threaded fake ranks on one GPU, float32 + bfloat16)"
check $PY -m pytest -q -x -p no:cacheprovider tests/test_attention.py tests/test_executor.py -k cuda
echo "== activation offload (side-stream copies, pinned pool): gradients of r = 0.5 equal r = 0"
check $PY -m pytest -q -s -p no:cacheprovider tests/test_offload.py -k cuda
for dtype in float32 bfloat16; do
  echo "== mixlen train: $NGPU ranks, nccl, $dtype, hdp"
  check mixlen train configs/debug.toml --nproc "$NGPU" \
    --set data.path="\"$DATA\"" --set train.device='"cuda"' --set train.dtype="\"$dtype\"" \
    --set train.steps=6 --set train.eval_interval=3 --set parallel.capacity=$CAP \
    --set metrics.dir="\"$RUN/$dtype\"" --set checkpoint.dir="\"$RUN/$dtype/ckpt\"" --set metrics.progress=false
  check $PY - "$RUN/$dtype/metrics.jsonl" <<'PYEOF'
import json, math, sys
recs = [json.loads(x) for x in open(sys.argv[1])]
assert len(recs) == 6 and all(math.isfinite(r["loss"]) for r in recs), recs
assert recs[-1]["loss"] < recs[0]["loss"], "loss did not fall"
print("ok:", [round(r["loss"], 3) for r in recs])
PYEOF
done
echo "== mixlen train with offload r = 0.5 (side streams, pinned pool) and checkpointing every:2, bf16"
check mixlen train configs/debug.toml --nproc "$NGPU" --set data.path="\"$DATA\"" \
  --set train.device='"cuda"' --set train.dtype='"bfloat16"' --set train.steps=4 \
  --set train.eval_interval=0 --set parallel.capacity=$CAP --set model.n_layers=4 \
  --set offload.enabled=true --set offload.force_ratio=0.5 \
  --set train.activation_checkpoint='"every:2"' \
  --set metrics.dir="\"$RUN/offload\"" --set checkpoint.dir="\"$RUN/offload/ckpt\"" --set metrics.progress=false
check $PY - "$RUN/offload/metrics.jsonl" <<'PYEOF'
import json, math, sys
recs = [json.loads(x) for x in open(sys.argv[1])]
assert len(recs) == 4 and all(math.isfinite(r["loss"]) for r in recs), recs
assert all(sum(r["offload_bytes_per_rank"]) > 0 for r in recs), "nothing moved to host"
print("ok: moved MiB per step", [round(sum(r["offload_bytes_per_rank"]) / 2**20, 1) for r in recs])
PYEOF
echo "== resume on GPU (3 more steps from the step-6 checkpoint)"
check mixlen train configs/debug.toml --nproc "$NGPU" --set data.path="\"$DATA\"" \
  --set train.device='"cuda"' --set train.steps=9 --set checkpoint.resume=true \
  --set parallel.capacity=$CAP \
  --set metrics.dir="\"$RUN/float32\"" --set checkpoint.dir="\"$RUN/float32/ckpt\"" --set metrics.progress=false
check $PY - "$RUN/float32/metrics.jsonl" <<'PYEOF'
import json, sys
steps = [json.loads(x)["step"] for x in open(sys.argv[1])]
assert steps == list(range(1, 10)), steps  # 6 steps, then 7..9 resumed from the checkpoint
print("ok: resumed, steps", steps)
PYEOF
if [ "$NGPU" -ge 2 ] && [ $((NGPU % 2)) -eq 0 ]; then
  echo "== tensor parallelism: tp 2 x $((NGPU / 2)) ranks, nccl, bf16; equal to tp 1 in float32"
  for tp in 1 2; do
    check mixlen train configs/debug.toml --nproc "$NGPU" --set data.path="\"$DATA\"" \
      --set train.device='"cuda"' --set train.steps=4 --set train.eval_interval=0 \
      --set parallel.capacity=$CAP --set parallel.tp=$tp --set checkpoint.interval=0 \
      --set metrics.dir="\"$RUN/tp$tp\"" --set checkpoint.dir="\"$RUN/tp$tp/ckpt\"" --set metrics.progress=false
  done
  check $PY - "$RUN/tp1/metrics.jsonl" "$RUN/tp2/metrics.jsonl" <<'PYEOF'
import json, sys
a, b = ([json.loads(x)["loss"] for x in open(p)] for p in sys.argv[1:])
assert len(a) == len(b) == 4 and all(abs(x - y) <= 1e-4 * abs(x) for x, y in zip(a, b)), (a, b)
print("ok: tp 2 losses", [round(x, 4) for x in b], "tp 1", [round(x, 4) for x in a])
PYEOF
else
  echo "tensor parallelism: not exercised (needs an even number >= 2 of GPUs)"
fi
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu_smoke: ${#FAILED[@]} step(s) failed ($RUN):" >&2; printf '  %s\n' "${FAILED[@]}" >&2; exit 1
fi
echo "gpu_smoke: all passed ($RUN)"
