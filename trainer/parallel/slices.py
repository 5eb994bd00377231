"""The flat parameter layout and its per-rank slices: the one slice ownership of ZeRO and CO2.

A model's trainable parameters, in a fixed order, are laid end to end into one flat vector of
`numel` elements. The vector is cut into `ranks` contiguous slices of padded length S
(`datapipe.plan.memory.slice_length`: ceil(numel / ranks) rounded up to `align` elements, so
every slice of every buffer starts on an aligned boundary); rank i owns [i*S, (i+1)*S) clipped to
`numel`, so the last slices may be shorter or empty. Flat buffers are allocated with the padded
length ranks*S, so slices are equal chunks for collectives; the padding is never read.

ZeRO (trainer.parallel.zero) shards the optimizer state by these slices, CO2 (trainer.islands.co2) its outer
state; both receive the same `FlatLayout`, built once per island. Checkpoints see a slice by
whole parameter (`ParamChunks`: boxes of each parameter it covers). Pure torch: no process group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from datapipe.plan.memory import slice_bounds, slice_length

__all__ = [
    "Bucket",
    "FlatLayout",
    "ParamChunks",
    "Part",
    "Place",
    "boxes",
    "checkpointable",
    "plain_places",
]


def checkpointable(
    t: torch.Tensor,
    global_shape: Sequence[int],
    boxes: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]],
) -> torch.Tensor:
    """Mark `t` as holding `boxes` (global offset, local offset, size) of a tensor of
    `global_shape`, for torch.distributed.checkpoint (DCP's CheckpointableTensor protocol, torch
    >= 2.14): DCP saves each box as that chunk of the global tensor and loads into it whatever
    saved chunks overlap it, so state saved in one layout loads into any other. Returns `t`."""
    t.global_shape = tuple(global_shape)  # type: ignore[attr-defined]
    t.global_offsets = tuple(tuple(g) for g, _, _ in boxes)  # type: ignore[attr-defined]
    t.local_offsets = tuple(tuple(o) for _, o, _ in boxes)  # type: ignore[attr-defined]
    t.local_sizes = tuple(tuple(z) for _, _, z in boxes)  # type: ignore[attr-defined]
    return t


class Place(NamedTuple):
    """Where the tensor a flat layout holds for parameter `name` sits in the whole parameter:
    a tensor-parallel shard at `offset` of `shape`, or (offset zero) the whole parameter."""

    name: str
    shape: tuple[int, ...]
    offset: tuple[int, ...]


def plain_places(shapes: Sequence[Sequence[int]]) -> list[Place]:
    """Places of whole parameters named p0, p1, ... (tests, layouts without a model)."""
    return [Place(f"p{i}", tuple(s), (0,) * len(s)) for i, s in enumerate(shapes)]


def boxes(shape: Sequence[int], start: int, end: int) -> list[tuple[tuple[int, ...], ...]]:
    """Elements [start, end) of a row-major tensor of `shape` as rectangular boxes (offset,
    size), in order; each box is contiguous in memory. At most 2 * len(shape) - 1 boxes."""
    shape = tuple(shape)
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner, rest = math.prod(shape[1:]), shape[1:]

    def row(r: int, a: int, b: int) -> list[tuple[tuple[int, ...], ...]]:
        return [((r, *o), (1, *z)) for o, z in boxes(rest, a, b)]

    r0, r1 = start // inner, (end - 1) // inner
    if r0 == r1:
        return row(r0, start - r0 * inner, end - r0 * inner)
    out = row(r0, start % inner, inner) if start % inner else []
    first, last = -(-start // inner), end // inner  # whole rows [first, last)
    if last > first:
        out.append(((first, *(0,) * len(rest)), (last - first, *rest)))
    if end % inner:
        out += row(last, 0, end % inner)
    return out


class ParamChunks:
    """A flat range [start, end) of a layout as pieces of whole parameters, for checkpoints:
    `pack(t)` gives, for every parameter with elements in the range, a tensor holding them as
    boxes of the whole parameter (checkpointable; a view of `t` where one box covers them, else
    a copy: only the range's first and last parameter can be cut mid-row), `unpack` copies such
    tensors back into the range. A checkpoint written this way names parameters, not flat
    offsets, so it loads at any rank count, ZeRO level or tensor-parallel degree."""

    def __init__(self, layout: FlatLayout, start: int, end: int, places: Sequence[Place]) -> None:
        if len(places) != len(layout.shapes):
            raise ValueError(f"{len(places)} places for {len(layout.shapes)} parameters")
        self.pieces: list[tuple[Place, int, list[tuple[tuple[int, ...], ...]]]] = []
        for part in layout.parts(start, end):
            place, local = places[part.param], layout.shapes[part.param]
            bx = boxes(local, part.param_start, part.param_start + part.length)
            self.pieces.append((place, part.range_start, bx))

    def pack(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """{parameter name: its elements of the range held by `t` (1-D), as boxes}."""
        out: dict[str, torch.Tensor] = {}
        for place, at, bx in self.pieces:
            if len(bx) == 1:
                (off, size), n = bx[0], math.prod(bx[0][1])
                packed = t[at : at + n].view(size)
                located = [(_add(off, place.offset), (0,) * len(size), size)]
            else:
                width = tuple(max(z[d] for _, z in bx) for d in range(1, len(place.shape)))
                packed = t.new_zeros((sum(z[0] for _, z in bx), *width))
                located, row = [], 0
                for off, size in bx:
                    n = math.prod(size)
                    piece = packed[(slice(row, row + size[0]), *(slice(0, w) for w in size[1:]))]
                    piece.copy_(t[at : at + n].view(size))
                    located.append((_add(off, place.offset), (row, *(0,) * len(width)), size))
                    row, at = row + size[0], at + n
            out[place.name] = checkpointable(packed, place.shape, located)
        return out

    @torch.no_grad()
    def unpack(self, packed: dict[str, torch.Tensor], t: torch.Tensor) -> None:
        """Copy tensors shaped like `pack(t)`'s back into `t` (views of `t` need nothing)."""
        names = {place.name for place, _, _ in self.pieces}
        if set(packed) != names:
            raise ValueError(f"parameters {sorted(packed)}, expected {sorted(names)}")
        for place, at, bx in self.pieces:
            src = packed[place.name]
            if len(bx) == 1 and src.data_ptr() == t[at:].data_ptr():
                continue  # a view of t: dcp.load filled it in place
            row = 0
            for _, size in bx:
                n = math.prod(size)
                piece = src[(slice(row, row + size[0]), *(slice(0, w) for w in size[1:]))]
                t[at : at + n].view(size).copy_(piece)
                row, at = row + size[0], at + n


def _add(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    return tuple(x + y for x, y in zip(a, b, strict=True))


class Part(NamedTuple):
    """The piece of parameter `param` that lies in a flat range: elements
    [param_start, param_start + length) of the flattened parameter sit at `range_start` relative
    to the start of the range."""

    param: int
    param_start: int
    range_start: int
    length: int


class Bucket(NamedTuple):
    """A piece of one slice: flat range [start, end), owned by rank `owner`."""

    index: int
    owner: int
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


class FlatLayout:
    """Where each parameter lives in the flat vector and which rank owns which slice."""

    def __init__(self, shapes: Sequence[Sequence[int]], ranks: int, align: int = 64) -> None:
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        if align < 1:
            raise ValueError(f"align must be >= 1 element, got {align}")
        self.shapes = [torch.Size(s) for s in shapes]
        self.ranks, self.align = int(ranks), int(align)
        numels = np.array([s.numel() for s in self.shapes], dtype=np.int64)
        self.offsets = np.zeros(len(numels) + 1, dtype=np.int64)
        np.cumsum(numels, out=self.offsets[1:])
        self.numel = int(self.offsets[-1])
        self.slice_len = slice_length(self.numel, self.ranks, self.align)
        self.padded_numel = self.ranks * self.slice_len

    @classmethod
    def from_params(cls, params: Sequence[torch.Tensor], ranks: int, align: int = 64) -> FlatLayout:
        """The layout of `params` in their given order."""
        return cls([p.shape for p in params], ranks, align)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, FlatLayout)
            and self.shapes == other.shapes
            and (self.ranks, self.align) == (other.ranks, other.align)
        )

    def __repr__(self) -> str:
        return (
            f"FlatLayout(params={len(self.shapes)}, numel={self.numel}, ranks={self.ranks}, "
            f"slice_len={self.slice_len})"
        )

    # -- slices ------------------------------------------------------------------------------------

    def slice(self, rank: int) -> tuple[int, int]:
        """[start, end) of `rank`'s slice (real elements only; may be empty)."""
        assert 0 <= rank < self.ranks
        return slice_bounds(self.numel, self.ranks, self.align, rank)

    def slice_numel(self, rank: int) -> int:
        start, end = self.slice(rank)
        return end - start

    def sizes(self) -> list[int]:
        """Real length of every rank's slice, in rank order (they sum to numel)."""
        return [self.slice_numel(r) for r in range(self.ranks)]

    def padded_slice(self, rank: int) -> tuple[int, int]:
        """[rank*S, (rank+1)*S): the rank's chunk of a padded flat buffer."""
        return rank * self.slice_len, (rank + 1) * self.slice_len

    def bytes_per_rank(self, dtype: torch.dtype, rank: int = 0) -> int:
        """Bytes of `rank`'s real slice of a buffer of `dtype`."""
        return self.slice_numel(rank) * torch.empty(0, dtype=dtype).element_size()

    # -- parameters inside flat ranges -------------------------------------------------------------

    def parts(self, start: int, end: int) -> list[Part]:
        """The parameter pieces covering flat range [start, end), in flat order."""
        if start >= end:
            return []
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        out = []
        i = first
        while i < len(self.shapes) and self.offsets[i] < end:
            p0, p1 = int(self.offsets[i]), int(self.offsets[i + 1])
            a, b = max(p0, start), min(p1, end)
            if b > a:
                out.append(Part(i, a - p0, a - start, b - a))
            i += 1
        return out

    def slice_parts(self, rank: int) -> list[Part]:
        """The parameter pieces inside `rank`'s slice (range_start relative to the slice)."""
        return self.parts(*self.slice(rank))

    def slice_views(
        self, slice_tensor: torch.Tensor, rank: int
    ) -> list[tuple[int, slice, torch.Tensor]]:
        """(parameter index, elements of the flattened parameter, 1-D view into `slice_tensor`)
        for each parameter piece in `rank`'s slice; `slice_tensor` holds that slice (at least
        slice_numel(rank) elements)."""
        assert slice_tensor.dim() == 1 and slice_tensor.numel() >= self.slice_numel(rank)
        return [
            (p.param, slice(p.param_start, p.param_start + p.length),
             slice_tensor[p.range_start : p.range_start + p.length])
            for p in self.slice_parts(rank)
        ]  # fmt: skip

    # -- buckets -----------------------------------------------------------------------------------

    def buckets(self, bucket_numel: int) -> list[Bucket]:
        """Each slice cut into pieces of at most `bucket_numel` elements (rounded down to the
        alignment, at least one alignment unit), listed in backward order (highest flat offset
        first: the order in which gradients become final when parameters are listed in forward
        order). Every bucket lies in one slice, so its reduction goes to a single owner."""
        step = max(self.align, bucket_numel // self.align * self.align)
        out: list[Bucket] = []
        for rank in reversed(range(self.ranks)):
            start, end = self.slice(rank)
            cuts = list(range(start, end, step))
            for a in reversed(cuts):
                out.append(Bucket(len(out), rank, a, min(a + step, end)))
        return out

    # -- copying between parameters and flat buffers ---------------------------------------------

    def new_flat(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zeroed padded flat buffer (ranks * slice_len elements)."""
        return torch.zeros(self.padded_numel, dtype=dtype, device=device)

    def _check(self, params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
        if [p.shape for p in params] != self.shapes:
            raise ValueError("parameters do not match the layout's shapes")
        if flat.dim() != 1 or flat.numel() < self.numel:
            raise ValueError(f"flat buffer of {flat.numel()} elements for {self.numel}")

    @torch.no_grad()
    def params_to_flat(self, params: Sequence[torch.Tensor], flat: torch.Tensor) -> torch.Tensor:
        """Copy the parameters into `flat` (casting to its dtype); returns `flat`."""
        self._check(params, flat)
        for p, a, b in zip(params, self.offsets[:-1], self.offsets[1:]):
            flat[int(a) : int(b)].copy_(p.detach().reshape(-1))
        return flat

    @torch.no_grad()
    def flat_to_params(self, flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
        """Copy `flat` into the parameters (casting to their dtype)."""
        self._check(params, flat)
        for p, a, b in zip(params, self.offsets[:-1], self.offsets[1:]):
            p.detach().copy_(flat[int(a) : int(b)].view(p.shape))

    def param_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` shaped like each parameter."""
        return [
            flat[int(a) : int(b)].view(s)
            for s, a, b in zip(self.shapes, self.offsets[:-1], self.offsets[1:])
        ]

    @torch.no_grad()
    def bind_params(self, params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
        """Copy the parameters into `flat`, then make each parameter's data a view of it, so that
        writing the flat buffer (e.g. an all-gather) updates the parameters without a copy."""
        if any(p.dtype != flat.dtype for p in params):
            raise ValueError(f"flat buffer is {flat.dtype}, parameters {params[0].dtype}")
        self.params_to_flat(params, flat)
        for p, v in zip(params, self.param_views(flat)):
            p.data = v
