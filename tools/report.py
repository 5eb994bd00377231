"""Balance reports for `mixlen plan` and `mixlen simulate`: metrics, tables, per-rank plots, HTML."""

from __future__ import annotations

import io
import os

import numpy as np

from datapipe.plan.cost import CostModel
from datapipe.plan.metrics import COMPONENTS, PlanMetrics, rank_components
from datapipe.plan.stepplan import StepPlan


def _fmt_groups(g: dict[int, int], limit: int = 3) -> str:
    if not g:
        return "-"
    items = sorted(g.items(), key=lambda kv: -kv[0])
    s = " ".join(f"{k}x{v}" for k, v in items[:limit])
    return s + (" ..." if len(items) > limit else "")


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(b) < 1000 or unit == "PB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{b:.0f} B"
        b /= 1000
    return f"{b:.1f} PB"


ROWS = (
    ("est. step time (s)", lambda m: f"{m.est_step_time_s:.3f}"),
    ("makespan (s)", lambda m: f"{m.makespan_s:.3f}"),
    ("mean rank time (s)", lambda m: f"{m.mean_rank_time_s:.3f}"),
    ("imbalance (max/mean)", lambda m: f"{m.imbalance:.3f}"),
    ("makespan / lower bound", lambda m: f"{m.max_over_lower_bound:.3f}"),
    ("token fill", lambda m: f"{100 * m.token_fill:.1f}%"),
    ("micro-batches/rank", lambda m: f"{m.mb_per_rank_min}..{m.mb_per_rank_max}"),
    ("CP groups (size x n)", lambda m: _fmt_groups(m.groups_by_size)),
    ("comm bytes", lambda m: _fmt_bytes(m.comm_bytes)),
    ("planning time (ms)", lambda m: f"{m.plan_ms:.1f}"),
)


def format_table(metrics: list[PlanMetrics], title: str = "") -> str:
    """Side-by-side table (one column per policy) plus hdp's speedup over static."""
    cols = [m.policy for m in metrics]
    cells = [[fn(m) for m in metrics] for _, fn in ROWS]
    w0 = max(len(r[0]) for r in ROWS)
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = [title] if title else []
    lines.append(" " * w0 + "  " + "  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for (name, _), row in zip(ROWS, cells):
        lines.append(name.ljust(w0) + "  " + "  ".join(v.rjust(w) for v, w in zip(row, widths)))
    by = {m.policy: m for m in metrics}
    if "static" in by:
        for p in cols:
            if p.startswith("hdp") and by[p].est_step_time_s > 0:
                sp = by["static"].est_step_time_s / by[p].est_step_time_s
                lines.append(f"speedup of {p} over static: {sp:.2f}x")
    return "\n".join(lines)


def plot_ranks(
    plans: list[StepPlan], cost: CostModel, path: str | None = None, title: str = ""
) -> bytes:
    """Per-rank stacked bars (attention, linear, exposed communication, exposed offload, overhead,
    idle) for each plan, one panel per policy; writes PNG to path and returns its bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = ("#d62728", "#1f77b4", "#ff7f0e", "#9467bd", "#7f7f7f", "#e6e6e6")
    fig, axes = plt.subplots(len(plans), 1, figsize=(14, 2.6 * len(plans) + 0.6), squeeze=False)
    for ax, plan in zip(axes[:, 0], plans):
        comp = rank_components(plan, cost)
        idle = np.maximum(plan.rank_time_ns / 1e9 - comp.sum(axis=1), 0)
        data = np.concatenate([comp, idle[:, None]], axis=1)
        x = np.arange(plan.num_ranks)
        bottom = np.zeros(plan.num_ranks)
        thin = plan.num_ranks > 128  # 1,024 ranks: bars touch, no edges
        for j, name in enumerate((*COMPONENTS, "idle")):
            ax.bar(
                x,
                data[:, j],
                bottom=bottom,
                width=1.0 if thin else 0.8,
                color=colors[j],
                linewidth=0,
                label=name,
            )
            bottom += data[:, j]
        ax.axhline(
            plan.lower_bound_ns / 1e9, color="k", linestyle="--", linewidth=0.8, label="lower bound"
        )
        name = plan.label
        ax.set_title(f"{name}: makespan {plan.makespan_ns / 1e9:.3f} s", fontsize=10, loc="left")
        ax.set_xlim(-0.5, plan.num_ranks - 0.5)
        step = max(1, -(-plan.num_ranks // 32))  # integer rank ticks, at most ~32 labels
        ax.set_xticks(np.arange(0, plan.num_ranks, step))
        ax.set_ylim(0, max(plan.makespan_ns, plan.lower_bound_ns, 1) / 1e9 * 1.08)
        ax.set_ylabel("seconds")
    axes[-1, 0].set_xlabel("rank")
    axes[0, 0].legend(loc="upper right", ncol=7, fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    data = buf.getvalue()
    if path:
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:  # a full disk: the old plot stays, no half-written one beside it
            if os.path.exists(tmp):
                os.remove(tmp)
    return data
