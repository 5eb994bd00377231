"""At-scale simulation: synthetic length distributions matching ByteScale's published statistics,
global batches drawn from them (or from a dataset's index), and predicted step times per policy.

Distributions are mixtures of segments (log-uniform, truncated power law, truncated lognormal, or a
point mass), with segment probabilities and shapes solved so the published figures hold in
expectation:

- ``byted``: ~80% of samples <= 4K tokens; 1% of samples >= 128K hold 44.3% of the tokens; 0.05%
  >= 2M hold 12.1%. Segments: [64, 4K] log-uniform (80%), (4K, 128K) power law (19%),
  [128K, 2M) power law (0.95%), 2M exactly (0.05%: the paper's 2M context caps them).
- ``github``: 16.2% of tokens in sequences > 128K, 9.8% > 256K. Segments: a lognormal body
  (median 1K, sigma 1.4) truncated at 128K, (128K, 256K] and (256K, 2M] log-uniform; their
  probabilities are solved from the two token shares.

Sampling is exact-count stratified (segment counts are the rounded expected counts, the remainder
drawn), so statistics of large draws sit close to the targets; tests check the tolerances.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from datapipe.errors import ConfigError
from datapipe.plan.compare import Variant

K = 1024
M = 1024 * 1024

# Paper figures (docs/ARCHITECTURE.md, "Reference figures") shown beside ours.
PAPER_ABLATION = {"naive-hdp": 1.59, "naive-hdp+offload": 2.01, "hdp+offload": 3.69}
PAPER_STEP_TIMES_S = {"static": 8 * 60 + 40, "naive-hdp": 4 * 60 + 32, "hdp+offload": 2 * 60 + 37}


@dataclass(frozen=True)
class Segment:
    """One mixture component on [lo, hi] (integers)."""

    kind: str  # "loguniform" | "power" | "lognormal" | "point"
    lo: float
    hi: float
    prob: float
    alpha: float = 1.0  # power: density ~ x^-alpha
    mu: float = 0.0  # lognormal
    sigma: float = 1.0

    def mean(self) -> float:
        lo, hi = self.lo, self.hi
        if self.kind == "point":
            return lo
        if self.kind == "loguniform":
            return (hi - lo) / math.log(hi / lo)
        if self.kind == "power":
            return _power_mean(lo, hi, self.alpha)
        if self.kind == "lognormal":
            return _trunc_lognormal_mean(self.mu, self.sigma, hi)
        raise ValueError(self.kind)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        u = rng.random(n)
        lo, hi = self.lo, self.hi
        if self.kind == "point":
            x = np.full(n, lo)
        elif self.kind == "loguniform":
            x = lo * np.exp(u * math.log(hi / lo))
        elif self.kind == "power":
            a = self.alpha
            if abs(a - 1.0) < 1e-12:
                x = lo * np.exp(u * math.log(hi / lo))
            else:
                e = 1.0 - a
                x = (lo**e + u * (hi**e - lo**e)) ** (1.0 / e)
        elif self.kind == "lognormal":
            x = np.exp(self.mu + self.sigma * rng.standard_normal(n))
            bad = x > hi
            while bad.any():
                x[bad] = np.exp(self.mu + self.sigma * rng.standard_normal(int(bad.sum())))
                bad = x > hi
        else:
            raise ValueError(self.kind)
        return np.clip(np.rint(x), max(1, math.ceil(lo)), math.floor(hi)).astype(np.int64)


def _power_mean(lo: float, hi: float, a: float) -> float:
    def integral(p: float) -> float:  # integral of x^p over [lo, hi]
        if abs(p + 1.0) < 1e-12:
            return math.log(hi / lo)
        return (hi ** (p + 1) - lo ** (p + 1)) / (p + 1)

    return integral(1.0 - a) / integral(-a)


def _solve_alpha(lo: float, hi: float, target: float) -> float:
    """Power-law exponent whose truncated mean on [lo, hi] is target (bisection; mean falls in a)."""
    a_lo, a_hi = -5.0, 8.0
    for _ in range(200):
        mid = (a_lo + a_hi) / 2
        if _power_mean(lo, hi, mid) > target:
            a_lo = mid
        else:
            a_hi = mid
    return (a_lo + a_hi) / 2


def _phi(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def _trunc_lognormal_mean(mu: float, sigma: float, hi: float) -> float:
    z = (math.log(hi) - mu) / sigma
    return math.exp(mu + sigma**2 / 2) * _phi(z - sigma) / _phi(z)


def byted(context: int = 2 * M) -> list[Segment]:
    """Byted-like mixture (see module docstring)."""
    p_a, p_b, p_c, p_d = 0.80, 0.19, 0.0095, 0.0005
    a = Segment("loguniform", 64, 4 * K, p_a)
    d_len = float(max(2 * M, 1))
    mean_total = p_d * d_len / 0.121  # 0.05% at 2M hold 12.1% of tokens
    m_c = (0.443 - 0.121) * mean_total / p_c
    m_b = ((1 - 0.443) * mean_total - p_a * a.mean()) / p_b
    b = Segment(
        "power", 4 * K + 1, 128 * K - 1, p_b, alpha=_solve_alpha(4 * K + 1, 128 * K - 1, m_b)
    )
    c = Segment("power", 128 * K, 2 * M - 1, p_c, alpha=_solve_alpha(128 * K, 2 * M - 1, m_c))
    d = Segment("point", d_len, d_len, p_d)
    del context
    return [a, b, c, d]


def github() -> list[Segment]:
    """GitHub-like mixture (see module docstring)."""
    body = Segment("lognormal", 1, 128 * K, 1.0, mu=math.log(1024), sigma=1.4)
    l1 = Segment("loguniform", 128 * K + 1, 256 * K, 0.0)
    l2 = Segment("loguniform", 256 * K + 1, 2 * M, 0.0)
    # Token shares: l1 6.4%, l2 9.8%, body 83.8%: p_i m_i = share_i * mean, sum p_i = 1.
    s1, s2 = 0.162 - 0.098, 0.098
    s0 = 1 - s1 - s2
    mean = 1.0 / (s0 / body.mean() + s1 / l1.mean() + s2 / l2.mean())
    p1, p2 = s1 * mean / l1.mean(), s2 * mean / l2.mean()
    return [
        Segment("lognormal", 1, 128 * K, 1 - p1 - p2, mu=body.mu, sigma=body.sigma),
        Segment("loguniform", l1.lo, l1.hi, p1),
        Segment("loguniform", l2.lo, l2.hi, p2),
    ]


DISTRIBUTIONS = {"byted": byted, "github": github}


def sample_lengths(name: str, n: int, seed: int = 0) -> np.ndarray:
    """n lengths from a named distribution, stratified by segment, in random order."""
    if name not in DISTRIBUTIONS:
        raise ConfigError(
            f"--lengths: unknown distribution '{name}' (known: byted, github, or a DIR)"
        )
    segs = DISTRIBUTIONS[name]()
    rng = np.random.Generator(np.random.PCG64(seed))
    probs = np.array([s.prob for s in segs])
    counts = np.floor(probs * n).astype(np.int64)
    rest = n - int(counts.sum())
    if rest:
        counts += np.bincount(rng.choice(len(segs), size=rest, p=probs), minlength=len(segs))
    parts = [s.sample(rng, int(c)) for s, c in zip(segs, counts)]
    out = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return out[rng.permutation(out.shape[0])]


def draw_batches(
    pool: np.ndarray, global_batch_tokens: int, steps: int, seed: int = 0
) -> list[np.ndarray]:
    """Global batches like the stream's fill rule: a shuffled order, taken greedily while the token
    sum stays <= the budget (a sample over the budget is a step of its own)."""
    rng = np.random.Generator(np.random.PCG64(seed + 1))
    out: list[np.ndarray] = []
    order = rng.permutation(pool.shape[0])
    pos = 0
    while len(out) < steps:
        if pos >= order.shape[0]:
            order = rng.permutation(pool.shape[0])
            pos = 0
        cs = np.cumsum(pool[order[pos:]])
        take = max(1, int(np.searchsorted(cs, global_batch_tokens, side="right")))
        if pos + take >= order.shape[0] and cs[-1] < global_batch_tokens and out == [] and pos == 0:
            raise ConfigError(
                f"dataset holds {int(cs[-1])} tokens, fewer than one global batch "
                f"({global_batch_tokens}); lower --global-batch-tokens"
            )
        out.append(pool[order[pos : pos + take]])
        pos += take
    return out


def length_stats(lengths: np.ndarray) -> dict[str, float]:
    """The published statistics, measured on a sample."""
    s = np.asarray(lengths, dtype=np.int64)
    tot = float(s.sum())
    return {
        "samples": int(s.size),
        "mean": float(s.mean()) if s.size else 0.0,
        "frac_samples_le_4k": float((s <= 4 * K).mean()),
        "frac_samples_ge_128k": float((s >= 128 * K).mean()),
        "frac_tokens_ge_128k": float(s[s >= 128 * K].sum() / tot),
        "frac_samples_ge_2m": float((s >= 2 * M).mean()),
        "frac_tokens_ge_2m": float(s[s >= 2 * M].sum() / tot),
        "frac_tokens_gt_128k": float(s[s > 128 * K].sum() / tot),
        "frac_tokens_gt_256k": float(s[s > 256 * K].sum() / tot),
    }


VARIANTS = (  # the columns of `mixlen simulate`
    Variant("static"),
    Variant("naive-hdp"),
    Variant("naive-hdp", offload=True),
    Variant("hdp"),
    Variant("hdp", offload=True),
)
WIDEN_VARIANTS = (Variant("hdp", widen=True), Variant("hdp", offload=True, widen=True))


def length_pool(source: str, context: int, min_samples: int, seed: int = 0) -> np.ndarray:
    """Lengths to draw batches from: a named distribution (min_samples draws) or a dataset's index;
    samples longer than the context are truncated to it (as preprocess --max-len would)."""
    if source in DISTRIBUTIONS:
        pool = sample_lengths(source, min_samples, seed)
    else:
        from datapipe.index import is_remote, read_lengths, read_manifest

        if not is_remote(source) and not os.path.isdir(source):
            names = ", ".join(DISTRIBUTIONS)
            raise ConfigError(f"--lengths: {source!r} is neither {names} nor a dataset folder")
        read_manifest(source)
        pool = read_lengths(source)
        pool = pool[pool > 0]
        if pool.size == 0:
            raise ConfigError(f"--lengths: dataset {source} has no non-empty samples")
    return np.minimum(pool, context)
