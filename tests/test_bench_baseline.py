"""benchmarks/at_revision.py (a module as it was at a git revision, loaded beside today's) and
bench_zero.py's `--update` mode that uses it: the logic runs, tiny, so neither rots."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_zero  # noqa: E402
from at_revision import module_at  # noqa: E402

from trainer.model import loss as today  # noqa: E402


def _has_git_history() -> bool:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True)
    return out.returncode == 0


pytestmark = pytest.mark.skipif(not _has_git_history(), reason="needs the repository's git history")


def test_a_module_at_a_revision_is_its_own_module() -> None:
    """HEAD's loss, loaded beside today's: another module object, the same arithmetic."""
    old = module_at("HEAD", "trainer/model/loss.py")
    assert old is not today and old.linear_cross_entropy is not today.linear_cross_entropy
    g = torch.Generator().manual_seed(0)
    h, w = (
        torch.randn(9, 4, generator=g, dtype=torch.float64),
        torch.randn(11, 4, generator=g, dtype=torch.float64),
    )
    labels = torch.randint(0, 11, (9,), generator=g)
    torch.testing.assert_close(
        old.linear_cross_entropy(h, w, labels), today.linear_cross_entropy(h, w, labels)
    )
    with pytest.raises(subprocess.CalledProcessError):
        module_at("HEAD", "no/such/file.py")


def test_update_rows_beside_a_revision() -> None:
    rows = bench_zero.update_times(4096, "HEAD", 1)
    assert [(r["clip"], r["optimizer"]) for r in rows] == [
        (1.0, "today"), (1.0, "HEAD"), (0.0, "today"), (0.0, "HEAD")
    ]  # fmt: skip
    assert all(r["seconds"] > 0 for r in rows) and rows[0]["x_today"] == 1.0
