"""Varlen zigzag ring attention over a dynamic group of ranks.

A group micro-batch holds one or more samples, each split zigzag over the ordered group G of k
ranks (datapipe.plan.zigzag fixes the chunks). Member p holds, per sample, chunks p and 2k-1-p back to
back; the samples follow each other in order. With that layout every hop is one of three blocks:

- hop 0 (own K/V): causal attention over the member's local tokens, per sample;
- K/V from member j < p: all local queries see chunk j of each sample (full);
- K/V from member j > p: the queries of chunk 2k-1-p see both chunks of j (full).

K/V (KV heads, un-expanded, stacked as one tensor) travel G[p] -> G[p+1] one hop per step, the
next hop posted before the current block is computed; partial outputs merge by log-sum-exp in
float32 (float64 for float64). Backward sends the K/V around again together with their dK/dV
accumulators, which after k hops arrive back at their owner. Ranks are island-local; no process
group is created per group.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from datapipe.plan.zigzag import chunk_bounds
from trainer.attention.local import accum_dtype, block_backward, block_forward, merge_partial
from trainer.attention.tape import taped
from trainer.attention.varlen import VarlenDocs, to_device
from trainer.parallel.comm import Communicator

__all__ = ["RingAttention", "ZigzagLayout", "ring_attend"]

_TAG_KV = 17
_TAG_DKV = 18


def _ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Concatenation of arange(start, start + size) for each pair (vectorized)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    seg_start = np.cumsum(sizes) - sizes
    return np.repeat(np.asarray(starts, dtype=np.int64) - seg_start, sizes) + np.arange(total)


def _cu(sizes: np.ndarray) -> list[int]:
    return [0, *np.cumsum(sizes).tolist()]


@dataclass(frozen=True)
class ZigzagLayout:
    """Where the tokens of a group micro-batch live: samples of `lengths`, each zigzag over k."""

    lengths: tuple[int, ...]
    k: int

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"group size must be >= 1, got {self.k}")
        if any(n < 0 for n in self.lengths):
            raise ValueError(f"sample lengths must be >= 0, got {self.lengths}")

    @functools.cached_property
    def sizes(self) -> np.ndarray:
        """Chunk sizes [n_samples, 2k]."""
        b = [chunk_bounds(n, self.k) for n in self.lengths]
        return np.diff(np.array(b, dtype=np.int64).reshape(len(self.lengths), -1), axis=1)

    @functools.cached_property
    def starts(self) -> np.ndarray:
        """Chunk starts within their sample [n_samples, 2k]."""
        return np.cumsum(self.sizes, axis=1) - self.sizes

    def _check(self, p: int) -> None:
        if not 0 <= p < self.k:
            raise ValueError(f"group index {p} outside a group of {self.k}")

    def front_sizes(self, p: int) -> np.ndarray:
        """Per sample, tokens of chunk p (member p's first chunk)."""
        self._check(p)
        return self.sizes[:, p]

    def back_sizes(self, p: int) -> np.ndarray:
        """Per sample, tokens of chunk 2k-1-p (member p's second chunk)."""
        self._check(p)
        return self.sizes[:, 2 * self.k - 1 - p]

    def local_cu(self, p: int) -> list[int]:
        """Boundaries of the samples within member p's local tokens (n_samples + 1)."""
        return _cu(self.front_sizes(p) + self.back_sizes(p))

    def local_count(self, p: int) -> int:
        return int(self.front_sizes(p).sum() + self.back_sizes(p).sum())

    def position_ids(self, p: int) -> np.ndarray:
        """Position within its sample of each of member p's local tokens."""
        q = 2 * self.k - 1 - p
        starts = np.stack([self.starts[:, p], self.starts[:, q]], axis=1).ravel()
        sizes = np.stack([self.front_sizes(p), self.back_sizes(p)], axis=1).ravel()
        return _ranges(starts, sizes)

    def global_index(self, p: int) -> np.ndarray:
        """Index of each of member p's local tokens in the concatenation of the whole samples."""
        offsets = np.cumsum(self.lengths, dtype=np.int64) - np.asarray(self.lengths, dtype=np.int64)
        n_local = self.front_sizes(p) + self.back_sizes(p)
        return self.position_ids(p) + np.repeat(offsets, n_local)

    def front_rows(self, p: int) -> np.ndarray:
        """Rows of member p's local buffer holding its chunk p tokens."""
        return _ranges(np.array(self.local_cu(p)[:-1]), self.front_sizes(p))

    def back_rows(self, p: int) -> np.ndarray:
        """Rows of member p's local buffer holding its chunk 2k-1-p tokens."""
        return _ranges(np.array(self.local_cu(p)[:-1]) + self.front_sizes(p), self.back_sizes(p))


@dataclass(frozen=True)
class _Hop:
    src: int  # group index whose K/V this hop uses
    src_count: int  # its number of local tokens
    q_rows: torch.Tensor | None  # query rows used (None: all)
    k_rows: torch.Tensor | None  # key rows of the source used (None: all)
    docs: VarlenDocs  # the block's documents (device boundaries built once, used by every layer)
    causal: bool


class RingAttention:
    """Attention context for one group micro-batch: ring attention of this rank's local tokens
    with the other members of `group` (island-local ranks, in ring order)."""

    def __init__(
        self,
        comm: Communicator,
        group: Sequence[int],
        group_index: int,
        lengths: Sequence[int],
        device: torch.device | str | None = None,
        backend: str | None = None,
    ) -> None:
        group = [int(r) for r in group]
        if len(set(group)) != len(group):
            raise ValueError(f"group has repeated ranks: {group}")
        if not 0 <= group_index < len(group) or group[group_index] != comm.rank:
            raise ValueError(
                f"rank {comm.rank} is not member {group_index} of group {group} in this plan"
            )
        self.comm = comm
        self.group = group
        self.p = group_index
        self.k = len(group)
        self.layout = ZigzagLayout(tuple(int(n) for n in lengths), self.k)
        self.next = group[(group_index + 1) % self.k]
        self.prev = group[(group_index - 1) % self.k]
        self.backend = backend
        self.hops = self._build_hops(torch.device(device) if device is not None else None)

    def _build_hops(self, device: torch.device | None) -> list[_Hop]:
        lay, p = self.layout, self.p
        dev = device or torch.device("cpu")

        def rows(x: np.ndarray) -> torch.Tensor:
            return to_device(x.astype(np.int64), dev)

        def docs(cu_q: list[int], cu_k: list[int]) -> VarlenDocs:
            return VarlenDocs(tuple(cu_q), tuple(cu_k))

        hops = []
        for t in range(self.k):
            j = (p - t) % self.k
            n_src = lay.local_count(j)
            own = lay.local_cu(p)
            if t == 0:
                hop = _Hop(j, n_src, None, None, docs(own, own), True)
            elif j < p:
                front = _cu(lay.front_sizes(j))
                hop = _Hop(j, n_src, None, rows(lay.front_rows(j)), docs(own, front), False)
            else:
                back = _cu(lay.back_sizes(p))
                hop = _Hop(
                    j, n_src, rows(lay.back_rows(p)), None, docs(back, lay.local_cu(j)), False
                )
            hops.append(hop)
        return hops

    @property
    def local_count(self) -> int:
        return self.layout.local_count(self.p)

    def attend(self, q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor) -> torch.Tensor:
        return ring_attend(q_THD, k_TKD, v_TKD, self)[0]

    def doc_lengths(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Per local token, the length of its whole sample (the layout's), the same on every
        member of the group."""
        lay = self.layout
        counts = lay.front_sizes(self.p) + lay.back_sizes(self.p)
        if int(counts.sum()) != position_ids.shape[0]:
            raise ValueError(
                f"member {self.p} holds {int(counts.sum())} tokens, position_ids "
                f"{position_ids.shape[0]}"
            )
        lengths = np.repeat(np.asarray(lay.lengths, dtype=np.int64), counts)
        return to_device(lengths, position_ids.device)

    # -- forward / backward bodies (no autograd) --

    def _forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.shape[0] != self.local_count or k.shape[0] != self.local_count:
            raise ValueError(
                f"member {self.p} holds {self.local_count} tokens, got q {q.shape[0]}, k {k.shape[0]}"
            )
        kv = torch.stack([k, v])  # [2, T, Hkv, D]
        out_acc: torch.Tensor | None = None
        lse_acc: torch.Tensor | None = None
        cur = kv
        for t, hop in enumerate(self.hops):
            handle, buf = None, None
            if t + 1 < self.k:  # post the next hop before computing this one
                buf = kv.new_empty((2, self.hops[t + 1].src_count, *kv.shape[2:]))
                handle = self.comm.send_recv(cur, self.next, buf, self.prev, _TAG_KV)
            qh = q if hop.q_rows is None else q.index_select(0, hop.q_rows)
            kh, vh = cur[0], cur[1]
            if hop.k_rows is not None:
                kh, vh = kh.index_select(0, hop.k_rows), vh.index_select(0, hop.k_rows)
            o, lse = block_forward(qh, kh, vh, hop.docs, None, hop.causal, backend=self.backend)
            if hop.q_rows is None:
                out_acc, lse_acc = merge_partial(out_acc, lse_acc, o, lse)
            else:
                assert out_acc is not None and lse_acc is not None  # hop 0 covers every row
                mo, ml = merge_partial(
                    out_acc.index_select(0, hop.q_rows), lse_acc.index_select(0, hop.q_rows), o, lse
                )
                out_acc.index_copy_(0, hop.q_rows, mo)
                lse_acc.index_copy_(0, hop.q_rows, ml)
            if handle is not None:
                handle.wait()
                cur = buf
        assert out_acc is not None and lse_acc is not None
        return out_acc.to(q.dtype), lse_acc

    def _backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = accum_dtype(q.dtype)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        tail = kv.shape[2:]
        cur = kv
        dkv_handle, dkv_buf = None, None
        final: torch.Tensor | None = None
        for t, hop in enumerate(self.hops):
            kv_handle, kv_buf = None, None
            if t + 1 < self.k:
                kv_buf = kv.new_empty((2, self.hops[t + 1].src_count, *tail))
                kv_handle = self.comm.send_recv(cur, self.next, kv_buf, self.prev, _TAG_KV)
            if hop.q_rows is None:
                qh, doh, oh, lh = q, dout, out, lse
            else:
                r = hop.q_rows
                qh, doh = q.index_select(0, r), dout.index_select(0, r)
                oh, lh = out.index_select(0, r), lse.index_select(0, r)
            kh, vh = cur[0], cur[1]
            if hop.k_rows is not None:
                kh, vh = kh.index_select(0, hop.k_rows), vh.index_select(0, hop.k_rows)
            dqh, dkh, dvh = block_backward(
                doh, qh, kh, vh, oh, lh, hop.docs, None, hop.causal, backend=self.backend
            )
            if hop.q_rows is None:
                dq += dqh
            else:
                dq.index_add_(0, hop.q_rows, dqh.to(acc))
            contrib = torch.zeros((2, hop.src_count, *tail), dtype=acc, device=q.device)
            if hop.k_rows is None:
                contrib[0] += dkh
                contrib[1] += dvh
            else:
                contrib[0].index_add_(0, hop.k_rows, dkh.to(acc))
                contrib[1].index_add_(0, hop.k_rows, dvh.to(acc))
            if dkv_handle is not None:  # the accumulator for this source, from earlier members
                dkv_handle.wait()
                contrib += dkv_buf
            if self.k > 1:  # pass it on; after the last hop it lands at its owner
                n_next = self.hops[t + 1].src_count if t + 1 < self.k else self.local_count
                dkv_buf = torch.empty((2, n_next, *tail), dtype=acc, device=q.device)
                dkv_handle = self.comm.send_recv(contrib, self.next, dkv_buf, self.prev, _TAG_DKV)
            else:
                final = contrib
            if kv_handle is not None:
                kv_handle.wait()
                cur = kv_buf
        if dkv_handle is not None:
            dkv_handle.wait()
            final = dkv_buf
        assert final is not None
        return dq.to(q.dtype), final[0].to(k.dtype), final[1].to(v.dtype)


class _RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring):  # type: ignore[override]
        out, lse = taped(lambda: ring._forward(q, k, v))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.ring._backward(dout, q, k, v, out, lse)
        return dq, dk, dv, None


def ring_attend(
    q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, ring: RingAttention
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention of this member's local tokens: (out_THD, lse_TH), differentiable in q, k, v.
    Every member of the ring must call it (and its backward) in the same order."""
    return _RingAttentionFn.apply(q_THD, k_TKD, v_TKD, ring)
