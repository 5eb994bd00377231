"""`mixlen eval`'s report: tables of the loss by position and by sample length and of the
passkey cases, and the passkey accuracy as a heatmap of depth against length."""

from __future__ import annotations

import math
import os
from typing import Any

__all__ = ["perplexity", "plot_passkey", "render"]


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def perplexity(loss: float) -> float:
    """exp(loss), infinite where the float would overflow (a loss above ~709)."""
    return math.exp(loss) if loss < 709.0 else math.inf


def _positions(result: dict[str, Any]) -> str:
    """What the loss is over: every labelled position, or, on a dataset with a loss mask, the
    trained ones only (the fetch labels only those)."""
    if result.get("loss_mask"):
        return "trained positions (the dataset's loss mask: the loss is over these only)"
    return "labelled positions"


def render(result: dict[str, Any]) -> str:
    """Markdown tables of a `run_eval` result."""
    lines = [
        f"mixlen eval {result['model']} on {result['data']} ({result['split']}): "
        f"{result['samples']} samples, {result['tokens']:,} {_positions(result)}, loss "
        f"{result['loss']:.4f}, perplexity {perplexity(result['loss']):.2f}",
    ]
    if result.get("beyond_context"):
        lines.append(
            f"note: {result['beyond_context']} samples are longer than the model's context "
            f"({result['context']:,} positions, its max_position_embeddings): their far "
            "positions measure extrapolation"
        )
    lines += [
        "",
        "| positions | loss | perplexity | tokens |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in result["by_position"]:
        lines.append(
            f"| {_k(r['start'])}-{_k(r['end'])} | {r['loss']:.4f} | {perplexity(r['loss']):.2f} | "
            f"{r['tokens']:,} |"
        )
    if result.get("by_source"):
        lines += [
            "",
            "| source | loss | perplexity | tokens | samples |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for name, r in result["by_source"].items():
            lines.append(
                f"| {name} | {r['loss']:.4f} | {perplexity(r['loss']):.2f} | {r['tokens']:,} | "
                f"{r['samples']} |"
            )
    lines += ["", "| sample length | loss | tokens | samples |", "| --- | ---: | ---: | ---: |"]
    for r in result["by_length"]:
        loss = "-" if r["loss"] is None or math.isnan(r["loss"]) else f"{r['loss']:.4f}"
        lines.append(
            f"| {_k(r['start'])}-{_k(r['end'])} | {loss} | {r['tokens']:,} | {r['samples']} |"
        )
    cases = result.get("passkey")
    if cases:
        right = sum(c["correct"] for c in cases)
        lines += [
            "",
            f"passkey retrieval: {right} of {len(cases)} answered",
            "",
            "| length | depth | answered | answer loss |",
            "| ---: | ---: | --- | ---: |",
        ]
        for c in cases:
            mark = "yes" if c["correct"] else "no"
            lines.append(
                f"| {c['length']:,} | {c['depth']:.0%} | {mark} | {c['answer_loss']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def plot_passkey(cases: list[dict[str, Any]], path: str) -> None:
    """A heatmap: rows the depths, columns the requested lengths, cells answered (1) or not (0),
    annotated with the answer loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths = sorted({c["requested_length"] for c in cases})
    depths = sorted({c["depth"] for c in cases})
    acc = np.full((len(depths), len(lengths)), np.nan)
    loss = np.full_like(acc, np.nan)
    for c in cases:
        i, j = depths.index(c["depth"]), lengths.index(c["requested_length"])
        acc[i, j], loss[i, j] = float(c["correct"]), c["answer_loss"]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.0 + 0.5 * len(depths)))
    ax.imshow(acc, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(lengths)), [_k(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("depth of the key")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not np.isnan(loss[i, j]):
                ax.text(j, i, f"{loss[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_title("passkey retrieval (green: answered; number: answer loss)", fontsize=9)
    fig.tight_layout()
    tmp = f"{path}.tmp-{os.getpid()}.png"
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)
    finally:  # a full disk: no half-written plot left
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
