"""The fetch's packing loop as a numba kernel: one pass over a micro-batch's positions writes its
input ids, labels and positions from the tokens read (datapipe.fetch.pack_microbatch). Releases
the GIL, so the background prefetch does not hold up the training thread.
"""

from __future__ import annotations

import numpy as np
from numba import njit


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
) -> None:
    """Piece i covers positions a[i]..b[i]-1 of a sample of sample_len[i] tokens whose tokens
    a[i].. sit at flat[starts[i]:]; it fills output rows cu[i]..cu[i+1]-1. A position's label is
    the next token of its sample; the sample's last position keeps the label it has (ignore)."""
    for i in range(a.shape[0]):
        lo, st, ai = cu[i], starts[i], a[i]
        n = b[i] - ai
        n_lab = min(b[i] + 1, sample_len[i]) - ai - 1
        for j in range(n):
            input_ids[lo + j] = flat[st + j]
            position_ids[lo + j] = ai + j
        for j in range(n_lab):
            labels[lo + j] = flat[st + 1 + j]
