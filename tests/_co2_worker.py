"""2 islands x 2 ranks over gloo (tests/test_islands.py): co2, diloco and sync through the executor,
the sharded optimizer and trainer.islands.cross against references that rank 0 computes with plain
torch (whole samples, torch.optim.AdamW inside each island, torch.optim.SGD or the contract's
formulas across islands); then the Trainer on a small dataset: resume mid-round and at a round
boundary with a round in flight, diloco and sync runs."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import torch.distributed as dist
from _train_worker import make_plan, model_config, train_config

from datapipe.fetch import MemoryFetcher
from datapipe.plan.loss import IGNORE_INDEX, labelled_positions
from trainer.islands.config import CO2Config
from trainer.islands.cross import CrossIsland
from trainer.model.transformer import build_model
from trainer.parallel.comm import init_local_gloo
from trainer.parallel.executor import HDPExecutor
from trainer.parallel.zero import ZeroOptimizer

ISLANDS, RANKS = 2, 2
F64 = torch.float64
LR, WD, CLIP = 3e-3, 0.1, 0.5
# 100 needs a ring of 2 ranks at capacity 64; the rest are packed short samples
LENGTHS = [100, 60, 20, 17, 30, 9, 25, 12, 5, 40, 3]
STEPS = 6
# the scenarios of run_mode: (name, mode, [co2] settings)
SCENARIOS = [
    ("co2-no-overlap", "co2", CO2Config(tau=3, outer_lr=0.7, outer_momentum=0.8,
                                        staleness_lambda=0.0, clip="none", overlap=False)),
    ("diloco", "diloco", CO2Config(mode="diloco", tau=3, outer_lr=0.7, outer_momentum=0.8,
                                   nesterov=False)),
    ("diloco-defaults", "diloco", CO2Config(mode="diloco", tau=3)),
    ("averaging", "co2", CO2Config(tau=1, outer_lr=1.0, outer_momentum=0.0, staleness_lambda=0.0,
                                   clip="none", overlap=False)),
    ("co2", "co2", CO2Config(tau=2, outer_lr=0.8, outer_momentum=0.6, nesterov=True,
                             staleness_lambda=0.5, clip="value", clip_value=2e-3,
                             warmup_rounds=0)),
    ("co2-warmup", "co2", CO2Config(tau=2, outer_lr=0.8, outer_momentum=0.6,
                                    staleness_lambda=0.5, warmup_rounds=1, warmup_outer_lr=0.9)),
    ("sync", "sync", CO2Config(mode="sync")),
    # STEPS not a multiple of tau: the last round is partial (trainer/islands/README.md)
    ("co2-partial", "co2", CO2Config(tau=4, outer_lr=0.8, outer_momentum=0.6, nesterov=True,
                                     staleness_lambda=0.5, clip="value", clip_value=2e-3,
                                     warmup_rounds=0)),
    ("co2-warmup-partial", "co2", CO2Config(tau=4, outer_lr=0.8, outer_momentum=0.6,
                                            staleness_lambda=0.5, warmup_rounds=2,
                                            warmup_outer_lr=0.9)),
    ("diloco-partial", "diloco", CO2Config(mode="diloco", tau=4, outer_lr=0.7,
                                           outer_momentum=0.8, nesterov=False)),
]  # fmt: skip
# the scenarios run again over gloo processes (tests/test_islands.py runs every one on threads): each
# communication pattern once (overlapped and blocking rounds, a partial last round after warm-up,
# diloco's, sync's); the others differ from these only in arithmetic the threads already check
GLOO_SCENARIOS = ("co2", "co2-no-overlap", "co2-warmup-partial", "diloco-partial", "sync")


def data() -> tuple[MemoryFetcher, list[np.ndarray]]:
    """Token store and the sample ids of island j's batch of step s at index s * ISLANDS + j."""
    rng = np.random.default_rng(5)
    tokens, batches = [], []
    for _ in range(STEPS * ISLANDS):
        ids = np.arange(len(tokens), len(tokens) + len(LENGTHS), dtype=np.int64)
        batches.append(ids[rng.permutation(len(LENGTHS))])
        tokens += [rng.integers(0, 200, size=n) for n in LENGTHS]
    return MemoryFetcher(tokens), batches


# --- the code under test: executor + sharded optimizer + trainer.islands.cross ---------------------------


def run_mode(comm, grad_comm, cross, mode: str, co2: CO2Config, tp: dict | None = None) -> dict:
    """STEPS steps of island `cross.rank` on this rank; returns its loss curve and final weights.
    `tp`: {"mesh", "comm"} of this rank's TP group (the model split over it; the weights
    returned whole; one HDP rank per island, capacity 128)."""
    fetcher, batches = data()
    model, master = build_model(model_config(), F64, seed=1)
    whole, capacity, kw = (lambda flat: flat), 64, {}
    if tp is not None:
        from trainer.parallel.tensor import parallelize, whole_flat

        for m in {id(model): model, id(master): master}.values():
            parallelize(m, tp["mesh"])
        whole, capacity, kw = (lambda flat: whole_flat(model, flat)), 128, {"tp_comm": tp["comm"]}
    sync = cross if mode == "sync" else None
    zero = ZeroOptimizer.for_model(
        model, comm, master=master, level=1, lr=LR, weight_decay=WD, grad_clip=CLIP,
        grad_comm=grad_comm, cross_comm=sync, async_gather=True, **kw,
    )  # fmt: skip
    ex = HDPExecutor(model, zero, comm, cross_comm=sync)
    rounds = CrossIsland(co2, zero, comm, cross) if mode != "sync" else None
    losses, records, waits = [], [], []
    for s in range(STEPS):
        ids = batches[s * ISLANDS + cross.rank]
        plan = make_plan("hdp", fetcher.lengths[ids], ids, comm.size, capacity)
        mine = plan.microbatches(comm.rank)
        fetched = fetcher.fetch_step([np.array(m.pieces, dtype=np.int64) for m in mine])
        res = ex.accumulate(plan, fetched, s)
        ex.update(res)
        losses.append(res.loss)
        waits.append(res.cross_wait_s)
        if rounds is not None:
            records.append(rounds.after_step())
    if rounds is not None:
        rounds.finish()
    zero.wait_weights()
    return {"losses": losses, "weights": whole(zero.flat_params[: zero.layout.numel].clone()),
            "records": records, "groups": sorted({int(k) for k in plan.group_sizes}),
            "cross_wait_s": waits}  # fmt: skip


# --- plain references (rank 0) ---------------------------------------------------------------------


class RefIsland:
    """One island trained on whole samples with torch.optim.AdamW (its state kept across rounds)."""

    def __init__(self) -> None:
        self.model, _ = build_model(model_config(), F64, seed=1)
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WD)

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    @torch.no_grad()
    def set(self, flat: torch.Tensor) -> None:
        off = 0
        for p in self.params:
            p.copy_(flat[off : off + p.numel()].view_as(p))
            off += p.numel()

    def step(self, fetcher: MemoryFetcher, ids: np.ndarray) -> float:
        """One step on the samples `ids` (the loss over their labelled positions)."""
        total = torch.zeros((), dtype=F64)
        for sid in ids.tolist():
            tok = torch.from_numpy(fetcher.flat[fetcher.offsets[sid] : fetcher.offsets[sid + 1]])
            labels = torch.cat([tok[1:], torch.tensor([IGNORE_INDEX])])
            loss, _ = self.model(tok, torch.arange(len(tok)), labels=labels)
            loss.backward()
            total += loss.detach()
        n = labelled_positions(fetcher.lengths[ids])
        for p in self.params:
            p.grad.div_(n)
        torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(total) / n


def _outer(anchor, d, st, c: CO2Config, stale: bool, alpha: float):
    """The contract's outer update (docs/ARCHITECTURE.md, "CO2 across islands"), `stale`: the
    average is one round late (only then penalised); heavy-ball without penalty or clipping
    through torch.optim.SGD."""
    lam = c.staleness_lambda if stale else 0.0
    if lam == 0 and c.clip == "none" and not c.nesterov:
        if "sgd" not in st:
            st["a"] = torch.nn.Parameter(anchor.clone())
            st["sgd"] = torch.optim.SGD([st["a"]], lr=alpha, momentum=c.outer_momentum)
        st["sgd"].param_groups[0]["lr"] = alpha
        st["a"].data.copy_(anchor)
        st["a"].grad = d.clone()
        st["sgd"].step()
        return st["a"].detach().clone()
    prev = st.get("d_prev", d)
    penalty = 1 + lam * torch.linalg.norm(d - prev) / (torch.linalg.norm(d) + 1e-8)
    if c.staleness_rule == "constant":
        penalty = 1 + lam
    m = c.outer_momentum * st.get("m", torch.zeros_like(d)) + d / penalty
    if c.clip == "value":
        m = m.clamp(-c.clip_value, c.clip_value)
    elif c.clip == "norm" and torch.linalg.norm(m) > c.clip_value:
        m = m * (c.clip_value / torch.linalg.norm(m))
    st["m"], st["d_prev"] = m, d
    step = d / penalty + c.outer_momentum * m if c.nesterov else m
    return anchor - alpha * step


def reference(mode: str, c: CO2Config) -> dict:
    """The islands' loss curves and the final weights, from the plain references."""
    fetcher, batches = data()
    isl = [RefIsland() for _ in range(ISLANDS)]
    losses: list[list[float]] = [[] for _ in range(ISLANDS)]
    if mode == "sync":  # one process on the union of the islands' batches
        for s in range(STEPS):
            union = np.concatenate(batches[s * ISLANDS : (s + 1) * ISLANDS])
            loss = isl[0].step(fetcher, union)
            for j in range(ISLANDS):
                losses[j].append(loss)
        return {"losses": losses, "weights": isl[0].flat()}
    anchor, st, pending = isl[0].flat(), {}, None
    for t in range(-(-STEPS // c.tau)):  # a last round of STEPS mod tau steps ends with the run
        deltas = []
        for j in range(ISLANDS):
            isl[j].set(anchor)
            for s in range(t * c.tau, min((t + 1) * c.tau, STEPS)):
                losses[j].append(isl[j].step(fetcher, batches[s * ISLANDS + j]))
            deltas.append(anchor - isl[j].flat())
        if c.tau == 1 and c.outer_momentum == 0 and c.outer_lr == 1 and not c.overlapped:
            anchor = sum(isl[j].flat() for j in range(ISLANDS)) / ISLANDS  # plain averaging
            continue
        avg = sum(deltas) / ISLANDS
        if c.overlapped and t >= c.warmup_rounds:  # one round stale
            if pending is not None:
                anchor = _outer(anchor, pending, st, c, True, c.outer_lr)
            pending = avg
        else:  # the round's own average: warm-up rounds at their outer lr
            alpha = c.warmup_outer_lr if c.overlapped else c.outer_lr
            anchor = _outer(anchor, avg, st, c, False, alpha)
    if pending is not None:
        anchor = _outer(anchor, pending, st, c, True, c.outer_lr)
    return {"losses": losses, "weights": anchor}


# --- the trainer ------------------------------------------------------------------------------------


def _trained(cfg, rt) -> tuple[list[float], torch.Tensor]:
    from trainer.trainer import Trainer

    with Trainer(cfg, rt) as t:
        summary = t.train()
        t.zero.wait_weights()
        return summary["losses"], t.zero.flat_params.clone()


def trainer_runs(rt, data_dir: str, out_dir: str) -> dict:
    """co2 through the Trainer: straight, and stopped after a mid-round step (3) or a round
    boundary with a round in flight (4) then resumed; diloco and sync runs."""
    co2 = {
        "tau": 2,
        "staleness_lambda": 0.5,
        "clip": "value",
        "clip_value": 0.01,
        "warmup_rounds": 1,
    }
    common = {"parallel": {"islands": 2, "capacity": 256}, "co2": co2}

    def cfg(name: str, **sections):
        merged = {**common, **sections}
        return train_config(data_dir, os.path.join(out_dir, name), **merged)

    out: dict = {}
    losses, weights = _trained(cfg("straight"), rt)
    out["straight"] = losses
    out["island_batches"] = island_batches(cfg("straight"), rt)
    for stop in (3, 4):
        a, _ = _trained(cfg(f"stop{stop}", train={"stop_after": stop}), rt)
        b, w = _trained(cfg(f"stop{stop}", checkpoint={"resume": True}), rt)
        out[f"stop{stop}"] = [a, b]
        assert a + b == losses, (stop, a, b, losses)
        assert torch.equal(w, weights), f"weights after the resume at {stop} differ"
    # after the last step every island holds the final anchor
    everyone = rt.cross_comm.all_gather(weights) if rt.cross_comm.size > 1 else [weights]
    assert all(torch.equal(x, weights) for x in everyone), "islands end with different weights"
    # 5 steps of tau 2: the last round (step 5) is partial and ends with the run
    dl, dw = _trained(cfg("diloco", train={"steps": 5}, co2={"tau": 2, "mode": "diloco"}), rt)
    assert all(torch.equal(x, dw) for x in rt.cross_comm.all_gather(dw))
    out["diloco"] = dl
    sl, _ = _trained(cfg("sync", train={"steps": 3}, co2={"mode": "sync"}), rt)
    got = rt.cross_comm.all_gather(torch.tensor(sl, dtype=F64))
    assert all(torch.equal(x, got[0]) for x in got), "sync islands report different losses"
    out["sync"] = sl
    return out


def island_batches(cfg, rt) -> list[list[list[int]]]:
    """Every island's [tokens, samples, labelled positions] of each step of `cfg`, from its
    stream (what each island trained on; the reference of the run's metrics, summed by hand)."""
    from contextlib import ExitStack

    with ExitStack() as stack:
        stream = cfg.train_data(rt.rank, rt.world, stack, island=rt.island, validation=False).stream
        mine = []
        for _ in range(cfg.train.steps):
            b = next(stream)
            mine.append([int(b.lengths.sum()), len(b.lengths), labelled_positions(b.lengths)])
    every = rt.cross_comm.all_gather(torch.tensor(mine, dtype=torch.int64))
    return [x.tolist() for x in every]


def main(rank: int, world: int, port: int, data_dir: str, out_dir: str) -> None:
    from trainer.parallel.runtime import setup_runtime

    init_local_gloo(rank, world, port, timeout_s=90)
    try:
        rt = setup_runtime("cpu", islands=ISLANDS)
        torch.set_num_threads(1)
        assert (rt.world, rt.island, rt.cross_comm.rank) == (RANKS, rank // RANKS, rank // RANKS)
        results: dict = {}
        for name, mode, c in SCENARIOS:
            if name not in GLOO_SCENARIOS:
                continue
            got = run_mode(rt.comm, rt.grad_comm, rt.cross_comm, mode, c)
            losses = rt.cross_comm.all_gather(torch.tensor(got["losses"], dtype=F64))
            if rank == 0:
                want = reference(mode, c)
                results[name] = {
                    "losses": [x.tolist() for x in losses],
                    "want_losses": want["losses"],
                    "weights_err": float(
                        (got["weights"] - want["weights"]).abs().max() / want["weights"].abs().max()
                    ),
                    "records": got["records"],
                    "groups": got["groups"],
                }
        results["trainer"] = trainer_runs(rt, data_dir, out_dir)
        if rank == 0:
            with open(os.path.join(out_dir, "co2.json"), "w") as f:
                json.dump(results, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
