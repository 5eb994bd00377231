"""Worker for tests/test_hf_model.py: one of 3 gloo processes running mixlen's model, loaded from a
Hugging Face folder, with ring attention; its logits are checked against transformers' (computed by
the test process, read from a file: no transformers import here). Per document, relative in norm:
1e-5 in float32, 1e-10 in float64."""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.attention.ring import RingAttention, ZigzagLayout
from trainer.model.pretrained import inspect_pretrained, load_pretrained_weights
from trainer.model.transformer import build
from trainer.parallel.comm import TorchComm, init_local_gloo

CASES = ["llama-dynamic", "qwen2", "mistral"]  # one per family
DTYPES = {"f32": torch.float32, "f64": torch.float64}
TOL = {"f32": 1e-5, "f64": 1e-10}
# (group in ring order, sample lengths): hdp-style (one sample over the group) and static-style
# (every sample over the whole group), on 2 and 3 of the 3 ranks
RINGS = [([1, 0], [100]), ([2, 1], [41, 70, 9]), ([2, 0, 1], [100]), ([0, 1, 2], [33, 70, 1, 41])]


def _check(
    comm: TorchComm, model: torch.nn.Module, ids, want, group, lengths, tol: float, what: str
) -> None:
    p = group.index(comm.rank)
    layout = ZigzagLayout(tuple(lengths), len(group))
    idx = torch.as_tensor(layout.global_index(p))
    pos = torch.as_tensor(layout.position_ids(p))
    with torch.no_grad():
        got = model(ids[idx], pos, attn=RingAttention(comm, group, p, lengths))
    assert got.dtype == want.dtype, f"{what}: logits in {got.dtype}, expected {want.dtype}"
    # per document: rows of this member that belong to it
    doc_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[idx]
    for d in range(len(lengths)):
        rows = doc_of == d
        if rows.any():
            w = want[idx][rows]
            err = float((got[rows] - w).to(torch.float64).norm() / w.to(torch.float64).norm())
            assert err <= tol, f"{what}, rank {comm.rank}, document {d}: relative error {err:.3g}"


def main(rank: int, world: int, port: int, reference: str, paths: dict[str, str]) -> None:
    torch.set_num_threads(1)
    init_local_gloo(rank, world, port, timeout_s=120)  # < the test's join timeout (240 s)
    try:
        comm = TorchComm()
        ref = torch.load(reference, weights_only=True)
        for case in CASES:
            pre = inspect_pretrained(paths[case])
            for name, dtype in DTYPES.items():
                model = build(pre.shape, dtype=dtype)
                load_pretrained_weights(model, pre)
                for i, (group, lengths) in enumerate(RINGS):
                    if rank in group:
                        ids, want = ref[f"{case}/{i}/ids"], ref[f"{case}/{i}/{name}"]
                        what = f"{case} {name} ring {group} {lengths}"
                        _check(comm, model, ids, want, group, lengths, TOL[name], what)
        dist.barrier()
    finally:
        dist.destroy_process_group()
