"""The fetch's packing loop as numba kernels: one pass over a micro-batch's positions writes its
input ids, labels and positions from the tokens read (datapipe.fetch.pack_microbatch), and, for a
dataset with a loss mask, one pass over the rows' trained spans marks the trained tokens read
and one over the pieces checks the labels they got against the index. All release the GIL, so
the background prefetch does not hold up the training thread.
"""

from __future__ import annotations

import numpy as np

from datapipe.jit import njit

IGNORE = -100  # datapipe.plan.loss.IGNORE_INDEX (a numba global: the kernel compiles it in)


@njit(cache=True, nogil=True)
def pack_kernel(
    flat: np.ndarray,
    starts: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    sample_len: np.ndarray,
    cu: np.ndarray,
    input_ids: np.ndarray,
    labels: np.ndarray,
    position_ids: np.ndarray,
    trained: np.ndarray,
    counts: np.ndarray,
) -> None:
    """Piece i covers positions a[i]..b[i]-1 of a sample of sample_len[i] tokens whose tokens
    a[i].. sit at flat[starts[i]:]; it fills output rows cu[i]..cu[i+1]-1. A position's label is
    the next token of its sample, where that token is trained (`trained`, aligned with `flat`;
    empty: every token is); other positions, and the sample's last, keep the label they have
    (ignore). counts[i]: the labels piece i got."""
    masked = trained.shape[0] > 0
    for i in range(a.shape[0]):
        lo, st, ai = cu[i], starts[i], a[i]
        n = b[i] - ai
        n_lab = max(min(b[i] + 1, sample_len[i]) - ai - 1, 0)
        # slices, not indexed writes: LLVM vectorizes the copies (3-4x the indexed loop)
        input_ids[lo : lo + n] = flat[st : st + n]
        pos = position_ids[lo : lo + n]
        for j in range(n):
            pos[j] = ai + j
        lab = labels[lo : lo + n_lab]
        nxt = flat[st + 1 : st + 1 + n_lab]
        if masked:  # arithmetic, not a branch (it vectorizes): the label, or IGNORE
            tr = trained[st + 1 : st + 1 + n_lab]
            got = 0
            for j in range(n_lab):
                t = np.int32(tr[j])
                lab[j] = (np.int32(nxt[j]) - IGNORE) * t + IGNORE
                got += t
            counts[i] = got
        else:
            for j in range(n_lab):
                lab[j] = nxt[j]
            counts[i] = n_lab


@njit(cache=True, nogil=True)
def mark_trained(
    row_off: np.ndarray, span_off: np.ndarray, spans: np.ndarray, trained: np.ndarray
) -> None:
    """Row r's tokens sit at trained[row_off[r]:row_off[r+1]]; its spans (pairs relative to the
    row) are spans[span_off[r]:span_off[r+1]]: set their tokens to 1 (`trained` starts at 0)."""
    for r in range(row_off.shape[0] - 1):
        base = row_off[r]
        for k in range(span_off[r], span_off[r + 1], 2):
            s, e = base + spans[k], base + spans[k + 1]
            if e > row_off[r + 1]:
                e = row_off[r + 1]
            trained[s:e] = 1  # a slice fill (3x the indexed loop, which does not vectorize)


@njit(cache=True, nogil=True)
def first_mislabelled(
    loss_tokens: np.ndarray,
    lengths: np.ndarray,
    offsets: np.ndarray,
    values: np.ndarray,
    sid: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    got: np.ndarray,
) -> tuple[int, int]:
    """(k, the index's count) of the first piece k whose labels got[k] are not the index's
    trained tokens of sample sid[k] in [lo[k], hi[k]), or (-1, 0): a whole sample's ([1, L))
    are its loss_tokens, a part's counted over its spans (values[offsets[s]:offsets[s + 1]], as
    LossMask.trained does)."""
    for k in range(sid.shape[0]):
        s, a, b = sid[k], lo[k], hi[k]
        if a == 1 and b == lengths[s]:
            want = loss_tokens[s]
        else:
            want = 0
            for q in range(offsets[s], offsets[s + 1], 2):
                x = max(values[q], a)
                y = min(values[q + 1], b)
                if y > x:
                    want += y - x
        if want != got[k]:
            return k, want
    return -1, 0
