"""Balance reports for `mixlen plan` and `mixlen simulate`: metrics, tables, per-rank plots, HTML."""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import numpy as np

from datapipe.plan.common import mb_spans_nodes
from datapipe.plan.cost import CostModel
from datapipe.plan.stepplan import StepPlan

COMPONENTS = ("attention", "linear", "communication", "offload", "overhead")


@dataclass
class PlanMetrics:
    """One plan's balance metrics (times in seconds)."""

    policy: str
    est_step_time_s: float
    mean_rank_time_s: float
    imbalance: float  # max / mean rank time
    lower_bound_s: float
    max_over_lower_bound: float
    token_fill: float  # tokens / sum of planned capacity over (rank, micro-batch)
    mb_per_rank_min: int
    mb_per_rank_max: int
    groups_by_size: dict[int, int]  # group size -> number of group micro-batches (k >= 2)
    comm_bytes: float  # ring K/V bytes sent by all members + offload bytes both directions
    plan_ms: float

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["groups_by_size"] = {str(k): v for k, v in self.groups_by_size.items()}
        return d


def mb_components(plan: StepPlan, cost: CostModel) -> np.ndarray:
    """Seconds of one member of each micro-batch by component [M, 5] (COMPONENTS order)."""
    m = plan.num_microbatches
    if m == 0:
        return np.zeros((0, len(COMPONENTS)))
    k = plan.group_sizes
    piece_mb = np.repeat(np.arange(m), np.diff(plan.mb_piece_offsets))
    s = plan.piece_end - plan.piece_start
    kp = k[piece_mb]
    attn = np.bincount(piece_mb, cost.attn_ns(s, kp), minlength=m)
    lin = np.bincount(piece_mb, cost.linear_ns(s, kp), minlength=m)
    member_tokens = np.bincount(piece_mb, s / kp, minlength=m)
    lin = lin + cost.size_ns(member_tokens)  # d*T^2: non-attention work of the micro-batch's size
    spans = mb_spans_nodes(cost, plan.mb_group_offsets, plan.group_ranks)
    ring = cost.ring_ns(member_tokens, k, spans)
    off = cost.offload_ns(member_tokens, plan.mb_offload).astype(np.float64)
    comp = attn + lin
    comm_exp = cost.ring_exposed_ns(attn.astype(np.int64), ring).astype(np.float64)
    fwd = np.floor(comp / 3)
    off_exp = np.maximum(off - fwd, 0) + np.maximum(off - (comp - fwd), 0)
    return np.stack([attn, lin, comm_exp, off_exp, np.full(m, float(cost.c_ns))], axis=1) / 1e9


def rank_components(plan: StepPlan, cost: CostModel) -> np.ndarray:
    """Per-rank seconds by component [N, 5] (COMPONENTS order); idle = rank time - row sum."""
    out = np.zeros((plan.num_ranks, len(COMPONENTS)))
    if plan.num_microbatches == 0:
        return out
    per_mb = mb_components(plan, cost)
    mb_of_member = np.repeat(np.arange(plan.num_microbatches), plan.group_sizes)
    np.add.at(out, plan.group_ranks.astype(np.int64), per_mb[mb_of_member])
    return out


def plan_metrics(plan: StepPlan, cost: CostModel, plan_ms: float) -> PlanMetrics:
    k = plan.group_sizes
    times = plan.rank_time_ns / 1e9
    mean = float(times.mean()) if times.size else 0.0
    mx = plan.makespan_ns / 1e9
    tokens = int((plan.piece_end - plan.piece_start).sum())
    cap_total = int((plan.mb_capacity * k).sum())
    counts = plan.microbatch_counts()
    piece_mb = np.repeat(np.arange(plan.num_microbatches), np.diff(plan.mb_piece_offsets))
    s = plan.piece_end - plan.piece_start
    member_tokens = np.bincount(piece_mb, s / k[piece_mb], minlength=plan.num_microbatches)
    ring = float((cost.ring_bytes(member_tokens, k) * k).sum())
    off = float((2 * cost.offload_bytes(member_tokens, plan.mb_offload) * k).sum())
    sizes, n = np.unique(k[k >= 2], return_counts=True)
    return PlanMetrics(
        policy=plan.label,
        est_step_time_s=mx,
        mean_rank_time_s=mean,
        imbalance=mx / mean if mean > 0 else 1.0,
        lower_bound_s=plan.lower_bound_ns / 1e9,
        max_over_lower_bound=plan.makespan_ns / plan.lower_bound_ns if plan.lower_bound_ns else 1.0,
        token_fill=tokens / cap_total if cap_total else 0.0,
        mb_per_rank_min=int(counts.min()) if counts.size else 0,
        mb_per_rank_max=int(counts.max()) if counts.size else 0,
        groups_by_size={int(a): int(b) for a, b in zip(sizes, n)},
        comm_bytes=ring + off,
        plan_ms=plan_ms,
    )


def average_metrics(steps: list[PlanMetrics]) -> PlanMetrics:
    """Mean over steps (sums for group counts; min/max for micro-batch counts)."""
    if len(steps) == 1:
        return steps[0]
    groups: dict[int, int] = {}
    for m in steps:
        for k, v in m.groups_by_size.items():
            groups[k] = groups.get(k, 0) + v

    def mean(attr: str) -> float:
        return float(np.mean([getattr(m, attr) for m in steps]))

    return PlanMetrics(
        policy=steps[0].policy,
        est_step_time_s=mean("est_step_time_s"),
        mean_rank_time_s=mean("mean_rank_time_s"),
        imbalance=mean("imbalance"),
        lower_bound_s=mean("lower_bound_s"),
        max_over_lower_bound=mean("max_over_lower_bound"),
        token_fill=mean("token_fill"),
        mb_per_rank_min=min(m.mb_per_rank_min for m in steps),
        mb_per_rank_max=max(m.mb_per_rank_max for m in steps),
        groups_by_size=dict(sorted(groups.items())),
        comm_bytes=mean("comm_bytes"),
        plan_ms=mean("plan_ms"),
    )


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
    ("mean rank time (s)", lambda m: f"{m.mean_rank_time_s:.3f}"),
    ("imbalance (max/mean)", lambda m: f"{m.imbalance:.3f}"),
    ("max / lower bound", lambda m: f"{m.max_over_lower_bound:.3f}"),
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
        ax.set_title(f"{name}: step {plan.makespan_ns / 1e9:.3f} s", fontsize=10, loc="left")
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
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    return data
