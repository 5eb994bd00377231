"""Spawned ranks of tests/test_tensor_parallel.py: the tensor-parallel decoder against the plain
one, float64, on gloo."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from datapipe.shapes import ModelConfig
from trainer.model.transformer import build
from trainer.parallel.comm import init_local_gloo

# (name, tp, shape): K/V split (tp divides n_kv_heads) and replicated (tp > n_kv_heads), tied and
# untied output, Q/K/V biases
CASES = [
    ("tp4-kv1-tied", 4, dict(n_kv_heads=1, tie_embeddings=True)),
    ("tp4-kv2-untied-bias", 4, dict(n_kv_heads=2, tie_embeddings=False, qkv_bias=True)),
    ("tp4-kv4-untied", 4, dict(n_kv_heads=4, tie_embeddings=False)),
    ("tp2-kv2-tied-bias", 2, dict(n_kv_heads=2, tie_embeddings=True, qkv_bias=True)),
    ("tp2-kv1-untied", 2, dict(n_kv_heads=1, tie_embeddings=False)),
]


def shape(**kw: object) -> ModelConfig:
    base = dict(vocab_size=64, dim=32, n_layers=2, n_heads=8, ffn_dim=48)
    return ModelConfig(**{**base, **kw})


def reference(cfg: ModelConfig, seed: int) -> torch.nn.Module:
    """The plain decoder, every weight (biases too) random."""
    torch.manual_seed(seed)
    model = build(cfg, dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def batch(group: int) -> tuple[torch.Tensor, ...]:
    """A packed micro-batch of three documents, different for each TP group."""
    g = torch.Generator().manual_seed(100 + group)
    lengths = [17, 9, 14]
    ids = torch.randint(0, 64, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, 17, 26, 40], dtype=torch.int32)
    labels = torch.roll(ids, -1)
    labels[cu[1:] - 1] = -100  # no label across a document's end
    labels[3] = -100
    return ids, pos, cu, labels


def main(rank: int, world: int, port: int, out_dir: str, data: str, pretrained: str) -> None:
    """Every 4-process check of tests/test_tensor_parallel.py in one spawn (one set of processes
    and one process group, ~10 s of start-up each): `reports` into out_dir/tp, `exactness` into
    out_dir/exact, `train_runs` into out_dir/train."""
    init_local_gloo(rank, world, port, timeout_s=60)
    try:
        reports(rank, os.path.join(out_dir, "tp"))
        exactness(rank, world, os.path.join(out_dir, "exact"))
        train_runs(rank, data, os.path.join(out_dir, "train"), pretrained)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def reports(rank: int, out_dir: str) -> None:
    """Each of CASES against the plain decoder, the bf16 errors, offload and selective
    checkpointing at tp: out_dir/rank{rank}.json."""
    from torch.distributed.tensor import DTensor

    from trainer.parallel.tensor import full_state_dict, parallelize, tp_mesh

    report = {}
    for name, tp, kw in CASES:
        cfg = shape(**kw)
        mesh = tp_mesh(tp)
        group = rank // tp  # the TP group (adjacent ranks)
        ref = reference(cfg, seed=7)
        model = reference(cfg, seed=7)
        parallelize(model, mesh)
        held = sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()
        )
        ids, pos, cu, labels = batch(group)
        loss_ref, n_ref = ref(ids, pos, cu, labels)
        (loss_ref / 29.0).backward()  # the caller scales the sum (by the step's labelled count)
        loss, n = model(ids, pos, cu, labels)
        (loss / 29.0).backward()
        full = full_state_dict(model)
        grads = {
            k: (g.full_tensor() if isinstance(g, DTensor) else g)
            for k, g in ((k, p.grad) for k, p in model.named_parameters())
        }
        weight_err = max((full[k] - p).abs().max().item() for k, p in ref.named_parameters())
        grad_err = max((grads[k] - p.grad).abs().max().item() for k, p in ref.named_parameters())
        with torch.no_grad():
            logit_err = (model(ids, pos, cu) - ref(ids, pos, cu)).abs().max().item()
        report[name] = {
            "tp": tp,
            "group": group,
            "loss": loss.item(),
            "loss_ref": loss_ref.item(),
            "n": int(n),
            "n_ref": int(n_ref),
            "weight_err": weight_err,
            "grad_err": grad_err,
            "logit_err": logit_err,
            "held": held,
            "is_dtensor": isinstance(model.layers[0].attention.wq.weight, DTensor),
            "bf16": bf16_errors(cfg, mesh, group),
        }
    report["offload"] = offload_check(rank)
    from _tp_selective import selective_check

    report["selective"] = selective_check(rank)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()


def bf16_errors(cfg: ModelConfig, mesh: object, group: int) -> dict[str, dict[str, float]]:
    """The plain and the tensor-parallel decoder in bfloat16 (the float64 reference's weights
    rounded), each against the float64 reference on the same micro-batch: the relative error of
    the loss, and the largest error of the logits and of the gradients relative to the
    reference's largest magnitude (tests/test_tensor_parallel.py compares the two)."""
    from torch.distributed.tensor import DTensor

    from trainer.parallel.tensor import parallelize

    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).double()

    ids, pos, cu, labels = batch(group)
    runs = {}
    for name in ("ref", "plain", "tp"):
        model = reference(cfg, seed=7)
        if name != "ref":
            model = model.to(torch.bfloat16)
        if name == "tp":
            parallelize(model, mesh)
        loss, _ = model(ids, pos, cu, labels)
        (loss / 29.0).backward()
        with torch.no_grad():
            logits = whole(model(ids, pos, cu))
        grads = {k: whole(p.grad) for k, p in model.named_parameters()}
        runs[name] = (float(loss.detach()), logits, grads)
    ref_loss, ref_logits, ref_grads = runs["ref"]
    out = {}
    for name in ("plain", "tp"):
        loss, logits, grads = runs[name]
        out[name] = {
            "loss": abs(loss - ref_loss) / abs(ref_loss),
            "logits": float((logits - ref_logits).abs().max() / ref_logits.abs().max()),
            "grads": max(
                float((grads[k] - g).abs().max() / g.abs().max()) for k, g in ref_grads.items()
            ),
        }
    return out


def saved_bytes(model: torch.nn.Module, inputs: tuple) -> list[int]:
    """Reference for the offload manager's accounting: the bytes of distinct storages each block
    saves first for backward (a tensor-parallel activation counted by its local tensor;
    parameters not counted), seen through plain saved-tensor hooks around each block."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    params = {
        (p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
        for p in model.parameters()
    }
    seen: set[int] = set()
    out = [0] * len(model.layers)

    def wrap(i: int, fwd: object) -> object:
        def pack(t: torch.Tensor) -> torch.Tensor:
            x = t
            while isinstance(x, (DTensor, AsyncCollectiveTensor)):
                x = x._local_tensor if isinstance(x, DTensor) else x.elem
            key = x.untyped_storage().data_ptr()
            if key and key not in params and key not in seen:
                seen.add(key)
                out[i] += x.untyped_storage().nbytes()
            return t

        def forward(*a: object, **k: object) -> object:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return fwd(*a, **k)

        return forward

    for i, blk in enumerate(model.layers):
        blk.forward = wrap(i, blk.forward)
    model(*inputs)[0].backward()
    for blk in model.layers:
        del blk.forward
    return out


def offload_check(rank: int) -> dict:
    """A 4-layer decoder at tp 4 (K/V replicated) and tp 2: one micro-batch under an activation
    manager offloading every block it may (ratio 1) against `saved_bytes` on the same model, and
    the gradients against the plain decoder's."""
    from trainer.offload.config import OffloadConfig
    from trainer.offload.manager import ActivationPolicy
    from trainer.offload.plan import HostNeed
    from trainer.parallel.tensor import parallelize, tp_mesh

    out = {}
    for tp in (4, 2):
        cfg = shape(n_layers=4, n_kv_heads=2)
        ids, pos, cu, labels = batch(rank // tp)
        model = parallelize(reference(cfg, seed=3), tp_mesh(tp))
        want = saved_bytes(model, (ids, pos, cu, labels))
        model.zero_grad()
        pol = ActivationPolicy("none", OffloadConfig(enabled=True, force_ratio=1.0, min_bytes=0))
        mgr = pol.build("cpu", HostNeed.of(cfg, 8, pol.checkpointed(cfg.n_layers)))
        with mgr.microbatch(model, 1.0) as st:
            model(ids, pos, cu, labels)[0].backward()
        ref = reference(cfg, seed=3)
        ref(ids, pos, cu, labels)[0].backward()
        got = {k: p.grad for k, p in model.named_parameters()}
        got = {k: g.full_tensor() if hasattr(g, "full_tensor") else g for k, g in got.items()}
        err = max((got[k] - p.grad).abs().max().item() for k, p in ref.named_parameters())
        out[f"tp{tp}"] = {
            "want": want,
            "blocks": list(st.block_bytes),
            "moved": st.moved_bytes,
            "offloaded": st.offloaded_blocks,
            "grad_err": err,
            "plain": saved_bytes(ref, (ids, pos, cu, labels)),
        }
    return out


# the executor at tp 2 x HDP 2 against the reference trainer (tests/test_tensor_parallel.py)
# (policy, ZeRO level, offload ratio forced)
# (policy, ZeRO level, forced offload ratio): ZeRO 1 and 2 at tp 2 each under offload (their
# plain runs at tp 1: tests/test_zero.py)
EXEC_CASES = [("hdp", 0, None), ("static", 0, None), ("hdp", 1, 1.0), ("static", 2, 0.5)]
# on 2 HDP ranks of capacity 64: 103 rings over both (hdp), static puts everything on a CP-2 mesh
EXEC_LENGTHS = [103, 60, 20, 17, 30, 9, 25, 12, 5, 40, 3]


def exactness(rank: int, world: int, out_dir: str) -> None:
    """4 processes as 2 HDP ranks x tp 2 (TP members adjacent): the exactness scenario of
    tests/_train_worker.py in float64 under each (policy, ZeRO level) of EXEC_CASES; rank 0 saves
    the whole gradients, loss curves and norms."""
    import _train_worker as w
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallel.comm import TorchComm

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    hdp = TorchComm(mesh.get_group("dp"))  # the ranks of this TP index
    tp = {"mesh": mesh["tp"], "comm": TorchComm(mesh.get_group("tp"))}
    for t in range(2):  # the gradient reductions' group of each TP index, created by every rank
        group = dist.new_group(list(range(t, world, 2)))
        if t == rank % 2:
            grad_comm = TorchComm(group)
    results = {}
    for policy, zero, offload in EXEC_CASES:
        got = w.run_policy(
            hdp,
            policy,
            torch.float64,
            zero=zero,
            grad_comm=grad_comm,
            lengths=EXEC_LENGTHS,
            tp=tp,
            offload=offload,
            shape=None if offload is None else w.offload_model_config(),  # 4 layers: 1-2 moved
        )
        results[(policy, zero, offload)] = got
    results["islands"] = islands_at_tp2(rank)
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "tp_exactness.pt"))
    dist.barrier()


# the islands' scenarios at tp 2 (tests/_co2_worker.py's, and global-norm clipping)
ISLAND_CASES = ["co2", "sync", "co2-clipnorm"]


def islands_at_tp2(rank: int) -> dict:
    """The same 4 processes as 2 islands x 1 HDP rank x tp 2: each scenario of ISLAND_CASES
    through the executor, ZeRO and trainer.islands.cross; rank 0's whole final weights and both
    islands' loss curves, and its outer records."""
    import _co2_worker as cw

    from trainer.islands.config import CO2Config
    from trainer.parallel.runtime import setup_runtime

    rt = setup_runtime("cpu", islands=2, tp=2)
    assert (rt.world, rt.island, rt.tp_rank) == (1, rank // 2, rank % 2)
    scenarios = {name: (mode, c) for name, mode, c in cw.SCENARIOS}
    clip = CO2Config(tau=2, outer_lr=0.8, outer_momentum=0.6, staleness_lambda=0.5, clip="norm")
    scenarios["co2-clipnorm"] = ("co2", dataclasses.replace(clip, clip_value=0.05))
    out = {}
    for name in ISLAND_CASES:
        mode, c = scenarios[name]
        tp = {"mesh": rt.tp_mesh, "comm": rt.tp_comm}
        got = cw.run_mode(rt.comm, rt.grad_comm, rt.cross_comm, mode, c, tp=tp)
        losses = rt.cross_comm.all_gather(torch.tensor(got["losses"], dtype=torch.float64))
        out[name] = {
            "mode": mode,
            "co2": c,
            "losses": [x.tolist() for x in losses],
            "weights": got["weights"],
            "records": got["records"],
        }
    return out


@contextlib.contextmanager
def counting_reads() -> Iterator[dict[str, int]]:
    """Count the elements this process reads from safetensors files (whole tensors and
    slices), by tensor name."""
    import safetensors

    real, read = safetensors.safe_open, {}

    class Counted:
        def __init__(self, *a: object, **k: object) -> None:
            self.f = real(*a, **k)

        def __enter__(self) -> Counted:
            self.f.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.__exit__(*exc)

        def get_tensor(self, name: str) -> torch.Tensor:
            t = self.f.get_tensor(name)
            read[name] = read.get(name, 0) + t.numel()
            return t

        def get_slice(self, name: str) -> object:
            sl = self.f.get_slice(name)

            class Sliced:
                def __getitem__(_, idx: object) -> torch.Tensor:
                    t = sl[idx]
                    read[name] = read.get(name, 0) + t.numel()
                    return t

            return Sliced()

    safetensors.safe_open = Counted
    try:
        yield read
    finally:
        safetensors.safe_open = real


@contextlib.contextmanager
def counting_dcp_reads() -> Iterator[dict[str, int]]:
    """Count the elements this process reads of each model weight from DCP checkpoints."""
    from trainer.checkpoint.files import SafeReader

    real, read = SafeReader.read_data, {}

    def read_data(self: SafeReader, plan: object, planner: object) -> object:
        for item in plan.items:
            fqn = item.dest_index.fqn
            if fqn.startswith("model.") and item.lengths is not None:
                read[fqn[6:]] = read.get(fqn[6:], 0) + int(torch.Size(item.lengths).numel())
        return real(self, plan, planner)

    SafeReader.read_data = read_data
    try:
        yield read
    finally:
        SafeReader.read_data = real


def evaluations(rt: object, data: str, ckpt: str, pretrained: str) -> dict:
    """`mixlen eval --nproc 4 --tp 2` of the checkpoint `ckpt` and of the Hugging Face folder
    `pretrained` (each read shard by shard: what this process read, by tensor)."""
    import argparse

    from tools.cmd_eval import _options, add_arguments
    from trainer.eval.cli import run_eval

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = [ckpt, data, "--split", "all", "--no-passkey", "--capacity", "1024"]
    with counting_dcp_reads() as ckpt_read:
        evaluated = run_eval(_options(parser.parse_args(argv)), rt)
    argv[0] = pretrained
    with counting_reads() as hf_read:
        hf_eval = run_eval(_options(parser.parse_args(argv)), rt)
    return {
        "eval": {k: evaluated[k] for k in ("loss", "tokens", "by_position")},
        "hf_eval": [hf_eval["loss"], hf_eval["tokens"], hf_read],
        "ckpt_read": ckpt_read,
    }


def train_runs(rank: int, data: str, out_dir: str, pretrained: str) -> None:
    """4 processes, `parallel.tp = 2` (2 HDP ranks): hdp for 6 steps comparing with static every
    3rd step; 3 steps then resume to 6; the step-3 checkpoint resumed at tp 1 (4 HDP ranks); 3
    steps at tp 1 resumed at tp 2; static with full activation checkpointing for 3 steps; one
    step from the Hugging Face folder `pretrained`; `evaluations`. Each process writes the loss
    curves to out_dir/losses{rank}.json."""
    from _train_worker import train_config

    from trainer.model.config import ModelSection
    from trainer.parallel.runtime import setup_runtime
    from trainer.train import run_training

    rt, tp = setup_runtime("cpu", tp=2), {"tp": 2}
    torch.set_num_threads(1)
    straight = run_training(
        train_config(
            data,
            os.path.join(out_dir, "straight"),
            parallel=tp,
            metrics={"compare": "static", "compare_interval": 3},
        ),
        rt,
    )
    part = os.path.join(out_dir, "part")
    first = run_training(train_config(data, part, parallel=tp, train={"stop_after": 3}), rt)
    second = run_training(train_config(data, part, parallel=tp, checkpoint={"resume": True}), rt)
    # the same 4 processes as 4 HDP ranks at tp 1: the tp 2 checkpoint of step 3 continues
    # there, and a tp 1 checkpoint of step 3 continues at tp 2
    rt1 = setup_runtime("cpu", tp=1)
    step3 = os.path.join(part, "ckpt", "step-00000003")
    to_tp1 = os.path.join(out_dir, "to_tp1")
    at_tp1 = run_training(
        train_config(data, to_tp1, checkpoint={"resume": step3, "interval": 0}), rt1
    )
    to_tp2 = os.path.join(out_dir, "to_tp2")
    first_tp1 = run_training(train_config(data, to_tp2, train={"stop_after": 3}), rt1)
    at_tp2 = run_training(train_config(data, to_tp2, parallel=tp, checkpoint={"resume": True}), rt)
    static = run_training(
        train_config(
            data,
            os.path.join(out_dir, "static"),
            train={"steps": 3, "activation_checkpoint": "full"},
            parallel={"policy": "static", **tp},
            checkpoint={"dir": None},
        ),
        rt,
    )
    pre = train_config(data, os.path.join(out_dir, "pre"), parallel=tp, checkpoint={"dir": None})
    pre.model = ModelSection(pretrained=pretrained)
    pre.train.steps = 1
    with counting_reads() as read:
        pre_run = run_training(pre, rt)
    out = {
        **evaluations(rt, data, os.path.join(out_dir, "straight", "ckpt"), pretrained),
        "pretrained": pre_run["losses"],
        "pretrained_read": read,
        "world": [rt.world, rt.tp, rt.tp_rank, rt.global_rank, rt.global_world],
        "straight": straight["losses"],
        "val": straight["val_losses"],
        "first": first["losses"],
        "second": second["losses"],
        "second_start": second["start_step"],
        "at_tp1": [at_tp1["start_step"], at_tp1["losses"]],
        "first_tp1": first_tp1["losses"],
        "at_tp2": [at_tp2["start_step"], at_tp2["losses"]],
        "static": static["losses"],
    }
    with open(os.path.join(out_dir, f"losses{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
