"""The plan report as a self-contained HTML page (`mixlen plan --html`, `mixlen simulate --html`).

One file, no network: the data is embedded as JSON and drawn by an inline script into SVG. The page
shows the policy table, planning times measured after a warm-up plan, a step selector (or all
steps) with per-rank timelines of each policy (micro-batches at their replayed start times, ring
groups linked across their members, exposed communication and offload, idle time, offload ratios),
and the dataset's length histogram. The markup and script are in `report_page.py`.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field

import numpy as np

from datapipe.plan.cost import CostModel
from datapipe.plan.metrics import PlanMetrics, mb_components
from datapipe.plan.stepplan import StepPlan, replay_starts
from tools.report import ROWS

MAX_TIMELINE_RANKS = 512  # ranks drawn per timeline (simulate at 1,024 ranks: the first 512)


@dataclass
class Timings:
    """Planning wall times of one policy: the warm-up pass over all steps (numba compiles or
    loads kernels on first use) and the timed pass after it, one call per step."""

    warmup_ms: float
    step_ms: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        ms = np.asarray(self.step_ms, dtype=np.float64)
        return {
            "warmup_ms": self.warmup_ms,
            "mean_ms": float(ms.mean()) if ms.size else 0.0,
            "min_ms": float(ms.min()) if ms.size else 0.0,
            "max_ms": float(ms.max()) if ms.size else 0.0,
            "steps": int(ms.size),
        }


def timeline(plan: StepPlan, cost: CostModel) -> dict:
    """One plan's timeline: per micro-batch its start and duration (s, slot-order replay), group
    (offsets into `ranks`), offload ratio and the fractions of its time that are exposed ring
    communication and exposed offload; per rank its estimated finish time."""
    n = min(plan.num_ranks, MAX_TIMELINE_RANKS)
    comp = mb_components(plan, cost)
    total = comp.sum(axis=1)
    safe = np.where(total > 0, total, 1.0)
    start = replay_starts(plan) / 1e9
    pieces = np.diff(plan.mb_piece_offsets)
    piece_mb = np.repeat(np.arange(plan.num_microbatches), pieces)
    tokens = np.bincount(
        piece_mb, plan.piece_end - plan.piece_start, minlength=plan.num_microbatches
    )
    return {
        "label": plan.label,
        "ranks": int(plan.num_ranks),
        "drawn_ranks": int(n),
        "makespan": plan.makespan_ns / 1e9,
        "lower_bound": plan.lower_bound_ns / 1e9,
        "rank_time": (plan.rank_time_ns[:n] / 1e9).round(9).tolist(),
        "start": start.round(9).tolist(),
        "dur": (plan.mb_time_ns / 1e9).round(9).tolist(),
        "group_offsets": plan.mb_group_offsets.tolist(),
        "group_ranks": plan.group_ranks.tolist(),
        "capacity": plan.mb_capacity.tolist(),
        "offload": plan.mb_offload.round(4).tolist(),
        "comm_frac": (comp[:, 2] / safe).round(4).tolist(),
        "offload_frac": (comp[:, 3] / safe).round(4).tolist(),
        "pieces": pieces.tolist(),
        "tokens": tokens.astype(np.int64).tolist(),
    }


def length_histogram(lengths: np.ndarray, capacity: int | None) -> dict:
    """Samples and token share per power-of-two length bin [2^i, 2^(i+1))."""
    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    if lengths.size == 0:
        return {"lo": [], "counts": [], "token_share": [], "capacity": capacity, "samples": 0}
    b = np.floor(np.log2(lengths)).astype(np.int64)
    lo_bin, hi_bin = int(b.min()), int(b.max())
    counts = np.bincount(b - lo_bin, minlength=hi_bin - lo_bin + 1)
    tok = np.bincount(b - lo_bin, weights=lengths, minlength=hi_bin - lo_bin + 1)
    return {
        "lo": [1 << i for i in range(lo_bin, hi_bin + 1)],
        "counts": counts.tolist(),
        "token_share": (tok / tok.sum()).round(6).tolist(),
        "capacity": capacity,
        "samples": int(lengths.size),
    }


def page_data(
    title: str,
    params: dict,
    metrics: list[PlanMetrics],
    steps: list[dict],
    timings: dict[str, Timings],
    hist: dict,
) -> dict:
    """Everything the page draws. `steps`: [{"step", "samples", "tokens", "plans": [timeline]}]."""
    by = {m.policy: m for m in metrics}
    speedups = []
    if "static" in by:
        for m in metrics:
            if m.policy.startswith("hdp") and m.est_step_time_s > 0:
                speedups.append([m.policy, by["static"].est_step_time_s / m.est_step_time_s])
    return {
        "title": title,
        "params": params,
        "policies": [m.policy for m in metrics],
        "table": [[name, [fn(m) for m in metrics]] for name, fn in ROWS],
        "speedups": speedups,
        "timings": {k: t.to_dict() for k, t in timings.items()},
        "steps": steps,
        "hist": hist,
    }


def render(data: dict) -> str:
    """The page: markup, style and script from report_page.py around the JSON data."""
    from tools.report_page import PAGE

    # no "<" at all inside the script element: neither "</script>" nor "<!--<script" (which
    # would make the parser take the page's own </script> as data) can appear
    blob = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")
    parts = {"__TITLE__": html.escape(data["title"]), "__DATA__": blob}
    return re.sub("__TITLE__|__DATA__", lambda m: parts[m.group()], PAGE)  # one pass


def write_page(path: str, data: dict) -> None:
    """Write the page atomically."""
    from datapipe.files import write_text_atomic

    write_text_atomic(path, render(data))
