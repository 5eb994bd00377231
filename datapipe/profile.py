"""Length statistics of a dataset from index.parquet alone (numpy + pyarrow; no token reads)."""

from __future__ import annotations

import numpy as np


def length_profile(
    lengths: np.ndarray, capacity: int | None = None, loss_tokens: np.ndarray | None = None
) -> dict:
    """Counts, percentiles and power-of-two buckets of sample lengths.

    Bucket b holds lengths in [2^b, 2^(b+1)) (bucket "0" also holds length 0); each bucket reports
    its samples and tokens. With `capacity`, the share of samples and tokens in samples longer
    than it (the ones HDP must split across ranks). With `loss_tokens` (a dataset with a loss
    mask: each sample's trained positions), the trained tokens and their share of the tokens,
    overall and per bucket.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = int(lengths.size)
    total = int(lengths.sum()) if n else 0
    out: dict = {"num_samples": n, "num_tokens": total}
    if n == 0:
        out.update({k: 0 for k in ("min", "p50", "p90", "p99", "max", "mean")})
        out["buckets"] = []
    else:
        p50, p90, p99 = np.percentile(lengths, [50, 90, 99], method="lower")
        out.update(
            min=int(lengths.min()),
            p50=int(p50),
            p90=int(p90),
            p99=int(p99),
            max=int(lengths.max()),
            mean=float(total / n),
        )
        # floor(log2(L)) without floating point: bit_length - 1, vectorised through frexp-free ops
        b = np.zeros(n, dtype=np.int64)
        pos = lengths > 0
        b[pos] = np.floor(np.log2(lengths[pos].astype(np.float64))).astype(np.int64)
        # guard float rounding at exact powers of two
        b[pos] -= (np.left_shift(np.int64(1), b[pos]) > lengths[pos]).astype(np.int64)
        b[pos] += (np.left_shift(np.int64(1), b[pos] + 1) <= lengths[pos]).astype(np.int64)
        nb = int(b.max()) + 1
        samples = np.bincount(b, minlength=nb)
        tokens = np.bincount(b, weights=lengths, minlength=nb)
        out["buckets"] = [
            {
                "lo": 0 if i == 0 else 1 << i,
                "hi": 1 << (i + 1),
                "samples": int(samples[i]),
                "tokens": int(tokens[i]),
                "sample_share": float(samples[i] / n),
                "token_share": float(tokens[i] / total) if total else 0.0,
            }
            for i in range(nb)
            if samples[i]
        ]
        if loss_tokens is not None:
            trained = np.bincount(b, weights=np.asarray(loss_tokens, np.float64), minlength=nb)
            for bkt in out["buckets"]:
                i = int(bkt["lo"]).bit_length() - 1 if bkt["lo"] else 0
                bkt["loss_tokens"] = int(trained[i])
                bkt["loss_share"] = float(trained[i] / bkt["tokens"]) if bkt["tokens"] else 0.0
    if loss_tokens is not None:
        out["num_loss_tokens"] = int(np.asarray(loss_tokens, np.int64).sum())
        out["loss_share"] = float(out["num_loss_tokens"] / total) if total else 0.0
    if capacity is not None:
        if capacity < 1:
            raise ValueError(f"--capacity must be >= 1, got {capacity}")
        long = lengths > capacity
        out["capacity"] = int(capacity)
        out["long_samples"] = int(long.sum())
        out["long_sample_share"] = float(long.mean()) if n else 0.0
        out["long_token_share"] = float(lengths[long].sum() / total) if total else 0.0
    return out


def format_profile(prof: dict, title: str = "") -> str:
    """A terminal table of `length_profile` output."""
    lines = []
    if title:
        lines.append(title)
    lines.append(
        f"samples {prof['num_samples']:,}  tokens {prof['num_tokens']:,}  "
        f"length min {prof['min']:,}  p50 {prof['p50']:,}  p90 {prof['p90']:,}  "
        f"p99 {prof['p99']:,}  max {prof['max']:,}"
    )
    masked = "num_loss_tokens" in prof
    if masked:
        lines.append(
            f"loss mask: {prof['num_loss_tokens']:,} trained tokens "
            f"({100 * prof['loss_share']:.2f}% of tokens)"
        )
    lines.append(
        f"{'length bucket':>22}  {'samples':>10}  {'% samples':>9}  {'tokens':>14}  {'% tokens':>8}"
        + (f"  {'% trained':>9}" if masked else "")
    )
    for bkt in prof["buckets"]:
        rng = f"[{bkt['lo']:,}, {bkt['hi']:,})"
        lines.append(
            f"{rng:>22}  {bkt['samples']:>10,}  {100 * bkt['sample_share']:>8.2f}%  "
            f"{bkt['tokens']:>14,}  {100 * bkt['token_share']:>7.2f}%"
            + (f"  {100 * bkt['loss_share']:>8.2f}%" if masked else "")
        )
    if "capacity" in prof:
        lines.append(
            f"longer than capacity {prof['capacity']:,}: {prof['long_samples']:,} samples "
            f"({100 * prof['long_sample_share']:.2f}%), {100 * prof['long_token_share']:.2f}% of tokens"
        )
    return "\n".join(lines)


def plot_profile(prof: dict, lengths: np.ndarray, path: str) -> None:
    """PNG: length histogram (log x) with the cumulative token-share curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    if lengths.size:
        hi = max(2, int(lengths.max()))
        bins = np.logspace(0, np.log10(hi) + 0.01, 60)
        ax.hist(lengths, bins=bins, color="#4c78a8", alpha=0.85, label="samples")
        ax.set_xscale("log")
        ax2 = ax.twinx()
        s = np.sort(lengths)
        ax2.plot(s, np.cumsum(s) / s.sum(), color="#e45756", lw=2, label="cumulative token share")
        ax2.set_ylim(0, 1.02)
        ax2.set_ylabel("share of tokens in samples <= length")
        if "capacity" in prof:
            ax.axvline(
                prof["capacity"], color="k", ls="--", lw=1, label=f"capacity {prof['capacity']:,}"
            )
    ax.set_xlabel("sample length (tokens, log scale)")
    ax.set_ylabel("samples")
    ax.set_title(f"{prof['num_samples']:,} samples, {prof['num_tokens']:,} tokens")
    ax.legend(loc="upper left")
    save_figure(fig, path)


def save_figure(fig, path: str) -> None:
    """Write a matplotlib figure as PNG to a temporary path, then rename it into place."""
    import os

    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
