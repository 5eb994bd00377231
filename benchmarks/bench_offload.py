"""Activation offload and checkpointing on one long sequence, and what offload does to the
planner's group sizes.

Part 1 (the mechanism, trainer.offload.manager): peak kept activation bytes and step time, side by side in
one run, for

    plain        the model's own forward/backward (no manager)
    none         the manager, nothing moved or recomputed (its hook overhead)
    ckpt full    every block recomputed in backward
    ckpt selective  every block keeps its matmul and attention outputs, recomputes the rest
    offload 0.5  ceil(0.5*(l-2)) blocks' saved tensors in host memory between forward and backward
    offload 1    l-2 blocks to host (Eq. 3's r = 1)
    ckpt+off 1   every block recomputed and the checkpointed inputs of l-2 blocks to host

"peak" is the accounted peak of saved-activation bytes resident on the compute device (a block in
transit counts); "Eq. 3" is ByteScale's (2 + (1-r)(l-2)) * Act(s) with the planner's Act(s): the
cost model's act_bytes_per_token_layer of this shape times the length. A checkpointed block also
holds its recomputed activations during its own backward, which the saved-tensor accounting does not
see: "+recompute" adds one block's Act(s) to the checkpointed rows. On CPU the host and the "device"
are the same RAM and the copies run inline: "copy s" is the time inside the copies, and "hidden" is
the share of it a side stream would hide on the measured timeline (the copy-out of block i under the
forward of block i+1, the copy-in of block i under the backward of block i+1, per-block compute
times from the plain / ckpt full runs); "hidden @B" the same with copies taking bytes / B at the
cpu preset's host bandwidth B. Times are this thread's CPU time (torch runs one thread here), which
a shared box disturbs far less than wall time; each configuration keeps one manager (and host pool)
for the run, as a trainer does.

Part 2 (the planner): the group size D(s) of one sample of s tokens on the llama-7b preset (h100,
C = 8K, 1,024 ranks) without offload and with naive-hdp's Eq. 3 offload, the largest ratio whose
copies hide under the forward, and one rank's activation memory at 8K positions for r = 0, 0.5, 1
and full recomputation (ByteScale: r = 0.5 at 64K saved 32.3%, r = 1 as much as full recomputation).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_offload.py [--lengths 1024,2048,4096]

Prints the tables and writes benchmarks/out/bench_offload.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from datapipe.files import write_text_atomic  # noqa: E402
from datapipe.plan.cost import DEVICES, build_cost_model, preset  # noqa: E402
from datapipe.plan.planner import PlannerConfig  # noqa: E402
from trainer.model.transformer import build, get_config  # noqa: E402
from trainer.offload.config import OffloadConfig  # noqa: E402
from trainer.offload.manager import ActivationPolicy  # noqa: E402

CONFIGS: dict[str, tuple[str, float] | None] = {
    "plain": None,
    "none": ("none", 0.0),
    "ckpt full": ("full", 0.0),
    "ckpt selective": ("selective", 0.0),
    "offload 0.5": ("none", 0.5),
    "offload 1": ("none", 1.0),
    "ckpt+off 1": ("full", 1.0),
}
MIB = 1 << 20
GIB = 1 << 30


class _TimedCopies:
    """Wraps a copy engine: seconds spent in its copies, per block (copy-out: the block running
    forward; copy-in: the block that copied the buffer out)."""

    def __init__(self, inner: object, mgr: object) -> None:
        self.inner, self.mgr = inner, mgr
        self.out_s: dict[int, float] = {}
        self.in_s: dict[int, float] = {}
        self.owner: dict[int, int] = {}
        self.nbytes: dict[int, int] = {}

    def copy_out(self, src):
        block = self.mgr._active.fwd_block
        t0 = time.thread_time()
        buf = self.inner.copy_out(src)
        self.out_s[block] = self.out_s.get(block, 0.0) + time.thread_time() - t0
        self.nbytes[block] = self.nbytes.get(block, 0) + src.numel()
        self.owner[id(buf)] = block
        return buf

    def copy_in(self, buf, nbytes):
        t0 = time.thread_time()
        out = self.inner.copy_in(buf, nbytes)
        block = self.owner.get(id(buf), -1)
        self.in_s[block] = self.in_s.get(block, 0.0) + time.thread_time() - t0
        return out

    def wait(self, ready):
        self.inner.wait(ready)

    def reset(self) -> None:
        self.out_s, self.in_s, self.owner, self.nbytes = {}, {}, {}, {}


def block_times(model) -> tuple[list, list, list]:
    """Hooks recording per block the forward CPU time and, per block input, when its gradient
    arrived (block i's backward ends then; block i+1's input gradient marks its start)."""
    n = len(model.layers)
    fwd, grad_at = [0.0] * n, [0.0] * (n + 1)
    start = [0.0]
    handles = []
    for i, blk in enumerate(model.layers):

        def pre(_m, args, i=i):
            start[0] = time.thread_time()
            if args[0].requires_grad:
                args[0].register_hook(lambda g, i=i: grad_at.__setitem__(i, time.thread_time()))

        def post(_m, _args, out, i=i):
            fwd[i] = time.thread_time() - start[0]
            if i == n - 1 and out.requires_grad:
                out.register_hook(lambda g: grad_at.__setitem__(n, time.thread_time()))

        handles += [blk.register_forward_pre_hook(pre), blk.register_forward_hook(post)]
    return fwd, grad_at, handles


def step(model, batch, mgr, ratio: float) -> dict:
    """One forward/backward (through `mgr` unless None); stats, CPU seconds, per-block times."""
    ids, pos, labels = batch
    model.zero_grad(set_to_none=True)
    fwd, grad_at, handles = block_times(model)
    t0 = time.thread_time()
    try:
        if mgr is None:
            loss, _ = model(ids, pos, labels=labels)
            loss.backward()
            out = {"s": time.thread_time() - t0}
        else:
            mgr.copies.reset()
            with mgr.microbatch(model, ratio) as stats:
                loss, _ = model(ids, pos, labels=labels)
                loss.backward()
            out = {"s": time.thread_time() - t0, **stats.__dict__}
            out["copy_out_s"], out["copy_in_s"] = dict(mgr.copies.out_s), dict(mgr.copies.in_s)
            out["copy_bytes"] = dict(mgr.copies.nbytes)
    finally:
        for h in handles:
            h.remove()
    out["fwd_s"] = fwd
    out["bwd_s"] = [grad_at[i] - grad_at[i + 1] for i in range(len(fwd))]
    return out


def hidden_share(res: dict, base: dict, bytes_per_s: float | None = None) -> float | None:
    """Share of the copy time a side stream hides on the timeline: block i's copy-out under block
    i+1's forward, its copy-in under block i+1's backward (compute times from `base`)."""
    outs, ins = res.get("copy_out_s") or {}, res.get("copy_in_s") or {}
    if bytes_per_s is not None:
        outs = {b: n / bytes_per_s for b, n in res.get("copy_bytes", {}).items()}
        ins = dict(outs)
    total = sum(outs.values()) + sum(ins.values())
    if total == 0:
        return None
    fwd, bwd = base["fwd_s"], base["bwd_s"]
    exposed = 0.0
    for b in set(outs) | set(ins):
        nxt = b + 1 if b + 1 < len(fwd) else None
        exposed += max(outs.get(b, 0.0) - (fwd[nxt] if nxt is not None else 0.0), 0.0)
        exposed += max(ins.get(b, 0.0) - (bwd[nxt] if nxt is not None else 0.0), 0.0)
    return 1.0 - exposed / total


def run(lengths: list[int], n_layers: int, dim: int, reps: int) -> list[dict]:
    cfg = get_config(
        "debug", dim=dim, n_heads=4, n_kv_heads=2, ffn_dim=3 * dim, n_layers=n_layers,
        tie_embeddings=False,
    )  # fmt: skip
    cost = build_cost_model("bench", cfg, DEVICES["cpu"], dtype_bytes=4)
    model = build(cfg, "meta", torch.float32).to_empty(device="cpu")
    model.init_weights(0)
    managers = {}
    for name, spec in CONFIGS.items():
        managers[name] = None
        if spec is not None:
            offload = OffloadConfig(enabled=spec[0] != "selective")  # selective: never offloads
            mgr = ActivationPolicy(spec[0], offload).build("cpu")
            mgr.copies = _TimedCopies(mgr.copies, mgr)
            managers[name] = mgr
    rows = []
    for n in lengths:
        gen = torch.Generator().manual_seed(n)
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
        batch = (ids, torch.arange(n), ids.roll(-1))
        times: dict[str, list[float]] = {k: [] for k in CONFIGS}
        last: dict[str, dict] = {}
        for rep in range(reps + 1):  # rep 0 warms up; configurations interleaved
            for name, spec in CONFIGS.items():
                res = step(model, batch, managers[name], spec[1] if spec else 0.0)
                if rep:
                    times[name].append(res["s"])
                last[name] = res
        act = cost.act_bytes_per_token_layer * n  # the planner's Act(s)
        for name, spec in CONFIGS.items():
            res = last[name]
            r = spec[1] if spec else 0.0
            ckpt = spec is not None and spec[0] != "none"
            base = last["ckpt full" if ckpt else "plain"]
            copy_s = sum((res.get("copy_out_s") or {}).values())
            copy_s += sum((res.get("copy_in_s") or {}).values())
            rows.append(
                {
                    "length": n,
                    "config": name,
                    "step_s": statistics.median(times[name]),
                    "peak_bytes": res.get("peak_bytes"),
                    "eq3_bytes": (2 + (1 - r) * (n_layers - 2)) * act
                    if spec and not ckpt
                    else None,
                    "recompute_peak_bytes": res["peak_bytes"] + rebuilt(spec[0], act, res)
                    if ckpt
                    else None,
                    "moved_bytes": res.get("moved_bytes"),
                    "copy_s": copy_s if spec else None,
                    "hidden": hidden_share(res, base),
                    "hidden_at_B": hidden_share(res, base, cost.offload_bytes_per_s),
                    "block_bytes": res.get("block_bytes"),
                    "fwd_s": res["fwd_s"],
                    "bwd_s": res["bwd_s"],
                }
            )
    return rows


def rebuilt(spec: str, act: float, res: dict) -> float:
    """Bytes a checkpointed block rebuilds while its backward runs: its whole Act(s), or under
    selective checkpointing what it does not keep."""
    if spec == "selective":
        return act - max(res["block_bytes"])
    return act


def _pct(x: float | None) -> str:
    return f"{100 * x:.0f}%" if x is not None else "-"


def table(rows: list[dict]) -> str:
    head = (
        "| length | config | peak MiB | Eq. 3 MiB | +recompute MiB | vs none | moved MiB "
        "| copy s | hidden | hidden @B | step CPU s | vs plain |"
    )
    out = [head, "| ---: | --- |" + " ---: |" * 10]
    base: dict[int, dict] = {}
    for r in rows:
        base.setdefault(r["length"], {})[r["config"]] = r
    for r in rows:
        b = base[r["length"]]
        peak = r["peak_bytes"]
        cells = [
            f"{r['length']:,}",
            r["config"],
            f"{peak / MIB:.1f}" if peak is not None else "-",
            f"{r['eq3_bytes'] / MIB:.1f}" if r["eq3_bytes"] is not None else "-",
            f"{rp / MIB:.1f}" if (rp := r["recompute_peak_bytes"]) is not None else "-",
            f"{(rp or peak) / b['none']['peak_bytes']:.2f}" if peak is not None else "-",
            f"{r['moved_bytes'] / MIB:.1f}" if r["moved_bytes"] is not None else "-",
            f"{r['copy_s']:.3f}" if r["copy_s"] is not None else "-",
            _pct(r["hidden"]),
            _pct(r["hidden_at_B"]),
            f"{r['step_s']:.3f}",
            f"{r['step_s'] / b['plain']['step_s']:.3f}",
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


# --- part 2: the planner ---------------------------------------------------------------------------

PLAN_LENGTHS = [1 << 16, 1 << 17, 1 << 18, 1 << 19, 1 << 20, 1 << 21]


def planner_rows(capacity: int = 8192, ranks: int = 1024) -> list[dict]:
    """D(s) of one sample without and with offload (naive-hdp: Eq. 3's smallest group)."""
    cost = preset("llama-7b")
    l_ = cost.num_layers
    rows = []
    for s in PLAN_LENGTHS:
        lengths = np.array([s], dtype=np.int64)
        row: dict = {"length": s}
        for label, offload in (("plain", False), ("offload", True)):
            config = PlannerConfig("naive-hdp", capacity=capacity)
            plan = config.build(cost, ranks, offload=offload).plan(lengths)
            k, r = int(plan.group_sizes[0]), float(plan.mb_offload[0])
            n = -(-s // k)  # positions of the largest member
            blocks = 2 + (1 - r) * (l_ - 2)
            row[label] = {
                "D": k,
                "r": r,
                "positions": n,
                "act_gib": blocks * cost.act_bytes_per_token_layer * n / GIB,
            }
        row["r_hidden"] = int(cost.max_offload_layers(lengths)[0]) / l_
        rows.append(row)
    return rows


def memory_rows(positions: int = 8192) -> list[dict]:
    """One rank's activation memory at `positions` for r = 0, 0.5, 1 (Eq. 3, the trainer's
    blocks) and with every block checkpointed (its inputs, plus one block's Act in recompute)."""
    shape = get_config("llama-7b")
    cost = preset("llama-7b")
    l_, act = shape.n_layers, cost.act_bytes_per_token_layer * positions
    full = l_ * act
    rows = []
    for r in (0.0, 0.5, 1.0):
        kept = (2 + (1 - r) * (l_ - 2)) * act
        rows.append({"config": f"offload r = {r:g}", "gib": kept / GIB, "saved": 1 - kept / full})
    ckpt = l_ * shape.dim * 2 * positions + act  # bf16 block inputs + one recomputed block
    rows.append({"config": "full recomputation", "gib": ckpt / GIB, "saved": 1 - ckpt / full})
    kept = shape.saved_bytes_per_token_layer(2, "selective") * positions
    sel = l_ * kept + act - kept  # what each block keeps + one block's rebuilt pointwise work
    rows.append({"config": "selective recomputation", "gib": sel / GIB, "saved": 1 - sel / full})
    return rows


def planner_table(rows: list[dict], mem: list[dict]) -> str:
    out = [
        "| length | D no offload | act GiB/rank | largest hidden r | D with offload | r planned "
        "| positions/rank | act GiB/rank |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        p, o = r["plain"], r["offload"]
        out.append(
            f"| {r['length'] // 1024}K | {p['D']} | {p['act_gib']:.1f} | {r['r_hidden']:.3f} | "
            f"{o['D']} | {o['r']:.3f} | {o['positions']:,} | {o['act_gib']:.1f} |"
        )
    out += [
        "",
        "| 8K positions, llama-7b bf16 | activation GiB | saved vs r = 0 |",
        "| --- | ---: | ---: |",
    ]
    out += [f"| {m['config']} | {m['gib']:.2f} | {100 * m['saved']:.1f}% |" for m in mem]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.layers < 4:
        ap.error("--layers must be >= 4 (with l = 2, Eq. 3's offload term vanishes)")
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    t0 = time.perf_counter()
    rows = run(lengths, args.layers, args.dim, args.reps)
    print(f"model: {args.layers} layers, dim {args.dim}, float32, {args.threads} thread(s); "
          f"median of {args.reps} steps; {time.perf_counter() - t0:.0f} s")  # fmt: skip
    print(table(rows))
    plan, mem = planner_rows(), memory_rows()
    print()
    print("planner: llama-7b@h100, C = 8K, 1,024 ranks, naive-hdp (Eq. 3's smallest D)")
    print(planner_table(plan, mem))
    out = os.path.join(ROOT, "benchmarks", "out")
    os.makedirs(out, exist_ok=True)
    doc = {"args": vars(args), "torch": torch.__version__, "rows": rows, "planner": plan}
    doc["memory"] = mem
    write_text_atomic(os.path.join(out, "bench_offload.json"), json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
