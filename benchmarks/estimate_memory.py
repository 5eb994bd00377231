"""One GPU's memory for one micro-batch of a model shape, estimated on a CPU: the real model's
forward and backward run on the meta device (shapes only, no data), attention through torch's own
varlen flash kernel (its meta function: the outputs the CUDA kernel allocates), the chunked loss,
and `train.activation_checkpoint` none / selective / full through the trainer's own
ActivationManager; torch's MemTracker (torch.distributed._tools.mem_tracker) counts what is alive
at the peak. Beside it, what the planner's memory model says for the same micro-batch
(datapipe.plan.memory.micro_batch_bytes: the blocks' kept bytes, the block being recomputed, a
block's backward, the loss; what `mixlen train` warns with) and the model state of one rank
(weights, float32 master, gradients, AdamW moments), so the longest document one GPU holds can be
read off before the GPU is lent.

An estimate, not a measurement: the CUDA caching allocator's fragmentation and workspaces, NCCL's
buffers and the CUDA context are not here (the longest document counts on `usable_bytes` of the
device: 95% less 1 GiB); bench_gpu's `longest` part measures the real thing.

    .venv/bin/python benchmarks/estimate_memory.py [--model llama3.2-1b] \
        [--tokens 8192,32768,65536,131072] [--device-mib 143771]

Prints a table and writes benchmarks/out/estimate_memory.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from datapipe.files import write_text_atomic  # noqa: E402
from datapipe.plan.memory import (  # noqa: E402
    CHECKPOINTS,
    H200_BYTES,
    micro_batch_bytes,
    preset_memory,
    usable_bytes,
)
from datapipe.shapes import MODEL_CONFIGS  # noqa: E402

# a MemTracker category -> counted as the micro-batch's (parameters, buffers, optimizer are not)
MICROBATCH = ("Activation", "Temp", "Gradient", "Other")


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


def tracked_peak(model: str, tokens: int, checkpoint: str, documents: int = 1) -> dict[str, int]:
    """MemTracker's peak bytes by category for one forward + backward of `tokens` positions in
    `documents` equal documents, the named shape in bfloat16 on the meta device, attention on the
    `cuda_flash` backend, each parameter's gradient dropped once accumulated (the trainer's
    ZeroOptimizer moves it into its float32 buffer, part of the model state); "microbatch" sums
    the categories of MICROBATCH."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from trainer.attention.local import LocalAttention
    from trainer.model.transformer import build
    from trainer.offload.manager import ActivationPolicy

    cfg = MODEL_CONFIGS[model]
    net = build(cfg, "meta", torch.bfloat16)
    # no offload: the manager's copy engine is never used, its host side is the CPU's
    manager = ActivationPolicy(checkpoint).build("cpu") if checkpoint != "none" else None
    for prm in net.parameters():  # as ZeroOptimizer's hooks: each .grad moved out at once
        prm.register_post_accumulate_grad_hook(_drop_grad)
    tracker = MemTracker()
    tracker.track_external(net)
    cu = [tokens * i // documents for i in range(documents + 1)]
    with tracker, warnings.catch_warnings():
        # the tracker names each None an autograd function returns for a non-tensor input
        warnings.filterwarnings("ignore", "Expected a tensor or a traceable", UserWarning)
        ids = torch.zeros(tokens, dtype=torch.int64, device="meta")
        pos = torch.zeros(tokens, dtype=torch.int64, device="meta")
        attn = LocalAttention(cu, backend="cuda_flash")
        with manager.microbatch(net) if manager is not None else contextlib.nullcontext():
            loss, _ = net(ids, pos, labels=ids, attn=attn)
            loss.backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("meta")]
    out = {str(k.value if hasattr(k, "value") else k): int(v) for k, v in peak.items()}
    out["microbatch"] = sum(out.get(k, 0) for k in MICROBATCH)
    return out


def planned(model: str, tokens: int, checkpoint: str) -> int:
    """The planner's bytes for the same micro-batch (what `mixlen train` warns with)."""
    return micro_batch_bytes(MODEL_CONFIGS[model], tokens, checkpoint)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3.2-1b", choices=sorted(MODEL_CONFIGS))
    p.add_argument(
        "--tokens",
        default="8192,32768,65536,131072",
        help="at least two distinct lengths, comma-separated (the longest document is read off "
        "the line through the two longest)",
    )
    p.add_argument(
        "--device-mib", type=int, default=H200_BYTES >> 20, help="an H200's, as torch reports it"
    )
    args = p.parse_args()
    lengths = sorted({int(t) for t in args.tokens.split(",")})
    if len(lengths) < 2 or lengths[0] < 1:
        p.error(f"--tokens {args.tokens}: expected at least two distinct positive lengths")
    state = preset_memory(args.model, 1)["zero0"]["total"]
    rows = []
    for checkpoint in CHECKPOINTS:
        for tokens in lengths:
            t0 = time.perf_counter()
            got = tracked_peak(args.model, tokens, checkpoint)
            plan = planned(args.model, tokens, checkpoint)
            rows.append({
                "model": args.model, "checkpoint": checkpoint, "tokens": tokens,
                "tracked": got["microbatch"], "planned": plan, "ratio": plan / got["microbatch"],
                "state": state, "total": state + got["microbatch"], "categories": got,
                "seconds": time.perf_counter() - t0,
            })  # fmt: skip
    device = args.device_mib << 20
    cap = usable_bytes(device)
    longest = {}
    for checkpoint in CHECKPOINTS:  # linear in T: the line through the two longest lengths
        (a, b) = [r for r in rows if r["checkpoint"] == checkpoint][-2:]
        slope = (b["tracked"] - a["tracked"]) / (b["tokens"] - a["tokens"])
        longest[checkpoint] = int((cap - state - (a["tracked"] - slope * a["tokens"])) / slope)
    print(
        f"{args.model}, bfloat16 with a float32 master, one rank (model state "
        f"{state / 1e9:.1f} GB), one document per micro-batch; GB"
    )
    print("| checkpoint | tokens | tracked peak | planned | planned / tracked | with state |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['checkpoint']} | {r['tokens']} | {r['tracked'] / 1e9:.2f} "
            f"| {r['planned'] / 1e9:.2f} | {r['ratio']:.3f} | {r['total'] / 1e9:.1f} |"
        )
    print(
        f"longest document in {device / 1e9:.1f} GB (usable {cap / 1e9:.1f}; tracked, linear in T): "
        + ", ".join(f"{k} {v:,}" for k, v in longest.items())
    )
    out = os.path.join(ROOT, "benchmarks", "out", "estimate_memory.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    write_text_atomic(out, json.dumps({"rows": rows, "longest": longest}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
