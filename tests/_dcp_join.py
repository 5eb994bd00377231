"""One DCP checkpoint from several ranks' state dicts, written by one process (for resharding
tests without process groups)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp

from trainer.parallel.slices import checkpointable


def flat_keys(sd: dict, prefix: str = "") -> dict:
    """A nested state dict with dotted keys (the names DCP gives its entries)."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def detached(sd: dict) -> dict:
    """A detached copy of a (nested) state dict, keeping each chunk's global offsets."""
    out = {}
    for k, t in sd.items():
        if isinstance(t, dict):
            out[k] = detached(t)
            continue
        c = t.detach().clone()
        for attr in ("global_shape", "global_offsets", "local_offsets", "local_sizes"):
            if hasattr(t, attr):
                setattr(c, attr, getattr(t, attr))
        out[k] = c
    return out


def as_one_rank(parts: list[torch.Tensor]) -> torch.Tensor:
    """Several ranks' checkpointable pieces of one tensor as one checkpointable tensor (what
    DCP's joint plan writes: a box several ranks hold, a replicated one, once)."""
    width = [max(t.shape[d] for t in parts) for d in range(1, parts[0].dim())]
    one = parts[0].new_zeros((sum(t.shape[0] for t in parts), *width))
    located, row, seen = [], 0, set()
    for t in parts:
        one[(slice(row, row + t.shape[0]), *(slice(0, w) for w in t.shape[1:]))] = t
        for g, lo, z in zip(t.global_offsets, t.local_offsets, t.local_sizes):
            if g not in seen:
                seen.add(g)
                located.append((g, (lo[0] + row, *lo[1:]), z))
        row += t.shape[0]
    return checkpointable(one, parts[0].global_shape, located)


def save_as_ranks(path: str, sds: list[dict]) -> None:
    """Write the state dicts of several ranks as ONE checkpoint, as their joint DCP save would:
    each sharded entry (a tensor with `global_offsets`) becomes the ranks' boxes side by side;
    other entries are taken from the first rank that has them. Checks the saved metadata has
    each distinct box once."""
    flats = [flat_keys(sd) for sd in sds]
    merged = {}
    for k in sorted({k for f in flats for k in f}):
        have = [f[k] for f in flats if k in f]
        if not hasattr(have[0], "global_offsets"):
            merged[k] = have[0]
            continue
        merged[k] = as_one_rank([t for t in have if t.numel()])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(merged, checkpoint_id=path)
    meta = dcp.FileSystemReader(path).read_metadata()
    for k, t in merged.items():  # one chunk per distinct box
        if hasattr(t, "global_offsets"):
            assert len(meta.state_dict_metadata[k].chunks) == len(t.local_sizes), k
