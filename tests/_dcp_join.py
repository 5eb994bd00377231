"""One DCP checkpoint from several ranks' state dicts, written by one process (for resharding
tests without process groups)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp


def save_as_ranks(path: str, sds: list[dict]) -> None:
    """Write the state dicts of several ranks as ONE checkpoint with one chunk per rank, as their
    joint DCP save would: each sharded key (a tensor with `global_offsets`) becomes the ranks'
    non-empty chunks side by side; other keys are taken from the first rank. Checks the saved
    metadata has one chunk per rank holding a part of each sharded key."""
    merged = {}
    for k in sds[0]:
        if not hasattr(sds[0][k], "global_offsets"):
            merged[k] = sds[0][k]
            continue
        parts = [sd[k] for sd in sds if sd[k].numel()]
        t = torch.cat(parts)
        t.global_shape = parts[0].global_shape
        t.global_offsets = tuple(p.global_offsets[0] for p in parts)
        t.local_offsets = tuple((sum(q.numel() for q in parts[:i]),) for i in range(len(parts)))
        t.local_sizes = tuple((p.numel(),) for p in parts)
        merged[k] = t
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(merged, checkpoint_id=path)
    meta = dcp.FileSystemReader(path).read_metadata()
    for k, t in merged.items():  # one chunk per rank that holds a part of the key
        if hasattr(t, "global_offsets"):
            assert len(meta.state_dict_metadata[k].chunks) == len(t.local_sizes), k
