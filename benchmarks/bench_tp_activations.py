"""Saved activations per process under tensor parallelism (trainer.parallel.tensor with the
activation manager of trainer.offload.manager).

One micro-batch of `--positions` positions through a decoder split over tp processes (gloo on
this CPU), forward + backward inside an ActivationManager that offloads every block it may
(`offload.force_ratio` 1): the bytes each block saves for its backward (the local tensors of the
DTensor activations counted), what moved to host, side by side for tp 1, 2 and 4. Without
sequence parallelism the norms, the residual stream and the inputs of the column-wise layers stay
whole in every member, so a block's bytes fall less than 1/tp.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_tp_activations.py [--positions 2048]

Prints a table and writes benchmarks/out/bench_tp_activations.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPE = {"vocab_size": 4096, "dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4}
SHAPE |= {"ffn_dim": 768}


def _rank(rank: int, world: int, port: int, positions: int, out: str) -> None:
    import torch

    from datapipe.shapes import ModelConfig
    from trainer.model.transformer import build_model
    from trainer.offload.config import OffloadConfig
    from trainer.offload.manager import ActivationPolicy
    from trainer.offload.plan import HostNeed
    from trainer.parallel.comm import init_local_gloo

    torch.set_num_threads(1)
    if world > 1:
        init_local_gloo(rank, world, port, timeout_s=120)
    cfg = ModelConfig(**SHAPE)
    model, _ = build_model(cfg, torch.float32, "cpu", seed=0)
    if world > 1:
        from trainer.parallel.tensor import parallelize, tp_mesh

        parallelize(model, tp_mesh(world))
    pol = ActivationPolicy("none", OffloadConfig(enabled=True, force_ratio=1.0, min_bytes=0))
    mgr = pol.build("cpu", HostNeed.of(cfg, 4, pol.checkpointed(cfg.n_layers)))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (positions,), generator=g)
    pos = torch.arange(positions)
    with mgr.microbatch(model, 1.0) as st:
        loss, _ = model(ids, pos, labels=torch.roll(ids, -1))
        loss.backward()
    if rank == 0:
        rec = {"tp": world, "block_bytes": st.block_bytes, "moved_bytes": st.moved_bytes}
        rec["offloaded_blocks"] = st.offloaded_blocks
        with open(out, "w") as f:
            json.dump(rec, f)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    from trainer.parallel.comm import free_port, spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=2048)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tp in (1, 2, 4):
            out = os.path.join(tmp, f"tp{tp}.json")
            if tp == 1:
                _rank(0, 1, 0, args.positions, out)
            else:
                spawn(_rank, tp, (tp, free_port(), args.positions, out), 300)
            with open(out) as f:
                rows.append(json.load(f))
    base = sum(rows[0]["block_bytes"]) / len(rows[0]["block_bytes"])
    print(f"{args.positions} positions, shape {SHAPE}")
    print("| tp | saved MiB per block, per process | share of tp 1 | ideal 1/tp | moved MiB |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        per = sum(r["block_bytes"]) / len(r["block_bytes"])
        r["share"] = per / base
        print(
            f"| {r['tp']} | {per / 2**20:.2f} | {r['share']:.2f} | {1 / r['tp']:.2f} | "
            f"{r['moved_bytes'] / 2**20:.2f} |"
        )
    os.makedirs(os.path.join(ROOT, "benchmarks", "out"), exist_ok=True)
    path = os.path.join(ROOT, "benchmarks", "out", "bench_tp_activations.json")
    with open(path, "w") as f:
        json.dump({"positions": args.positions, "shape": SHAPE, "rows": rows}, f, indent=2)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
