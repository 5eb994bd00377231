"""The compare mode's report (trainer.compare): both policies' predicted and measured times on the
same steps, the total, and each step's ratio with its spread."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["CLOCKS", "render_comparison"]

CLOCKS = {
    "wall": "the slowest rank's compute time per step (wall clock)",
    "cpu": "each micro-batch's CPU time replayed in the plan's order (ranks share cores here; "
    "the cost file is calibrated with --clock cpu)",
}


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _describe(rows: list[dict[str, Any]], prefix: str) -> str:
    """How a compared policy places samples: a static mesh's shape, or the dynamic policies'
    share of samples computed whole on one rank."""
    meta = rows[0][f"{prefix}meta"]
    if "cp" in meta:  # a static mesh
        cp = meta["cp"]
        split = f"every sample split over {cp} ranks" if cp > 1 else "every sample on one rank"
        return f"CP {cp} x DP {meta['dp']}: {split}"
    local = float(np.mean([r[f"{prefix}local_samples"] for r in rows]))
    return (
        f"each sample on as few ranks as it needs ({local:.0%} of the samples computed whole "
        "on one rank, no ring)"
    )


def render_comparison(rows: list[dict[str, Any]], interval: int, clock: str) -> str:
    """Markdown lines: the setup, the totals table, the per-step table and the ratios' spread."""
    every = "every step" if interval == 1 else f"every {_nth(interval)} step"
    if not rows:
        return f"compare: no step was compared ({every}; the run ended before one)\n"
    a, b = rows[0]["policy"], rows[0]["other_policy"]
    tot = {k: sum(r[k] for r in rows) for k in rows[0] if k.endswith("_s")}
    pa, pb = tot["predicted_s"], tot["other_predicted_s"]
    ma, mb = tot["measured_s"], tot["other_measured_s"]
    lines = [
        f"{a} vs {b} on the same {len(rows)} global batches ({every}; before the step, each "
        f"plan runs one timed pass without updating the model, {b} first on odd comparisons "
        "and second on even ones; both warmed up on the first):",
        f"  {a}: {_describe(rows, '')}",
        f"  {b}: {_describe(rows, 'other_')}",
        "",
        "| policy | predicted s | measured s, wall clock | measured s, CPU replayed |",
        "| --- | ---: | ---: | ---: |",
        f"| {a} | {pa:.2f} | {tot['measured_wall_s']:.2f} | {tot['measured_cpu_s']:.2f} |",
        f"| {b} | {pb:.2f} | {tot['other_measured_wall_s']:.2f} | "
        f"{tot['other_measured_cpu_s']:.2f} |",
        "",
        f"{a} is {mb / ma:.2f}x as fast as {b} on these batches (the planner predicted "
        f"{pb / pa:.2f}x). Measured: {CLOCKS[clock]}, summed over the steps.",
        "",
        f"| step | {b} ran | {a} s | {b} s | measured x | predicted x |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    ratios = []
    for r in rows:
        x = r["other_measured_s"] / r["measured_s"] if r["measured_s"] > 0 else float("nan")
        ratios.append(x)
        px = r["other_predicted_s"] / r["predicted_s"] if r["predicted_s"] > 0 else float("nan")
        when = "first" if r["other_first"] else "second"
        lines.append(
            f"| {r['step']} | {when} | {r['measured_s']:.3f} | {r['other_measured_s']:.3f} | "
            f"{x:.2f} | {px:.2f} |"
        )
    q = np.nanpercentile(ratios, [0, 25, 50, 75, 100])
    lines += [
        "",
        f"per-step measured ratio: median {q[2]:.2f}x, quartiles {q[1]:.2f}-{q[3]:.2f}x, "
        f"range {q[0]:.2f}-{q[4]:.2f}x over {len(ratios)} steps",
    ]
    return "\n".join(lines) + "\n"
