"""The loss rule's facts, beside the StepPlan contract (docs/ARCHITECTURE.md, "Loss and
exactness"): a step's loss is the sum of its token losses divided by its labelled positions, the
sum of (L - 1) over its samples, whichever rank computed which token. A sample's last position
has no next token: its label is IGNORE_INDEX.
"""

from __future__ import annotations

import numpy as np

__all__ = ["IGNORE_INDEX", "labelled_positions"]

IGNORE_INDEX = -100  # the label of a position without a next token (torch's cross-entropy default)


def labelled_positions(lengths: np.ndarray) -> int:
    """Loss denominator of a step: sum of L-1 over its non-empty samples."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return int(np.maximum(lengths - 1, 0).sum())
