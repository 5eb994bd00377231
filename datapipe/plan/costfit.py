"""Fit the cost model's terms (datapipe.plan.cost, mixlen-cost/2) to timings: what `mixlen
calibrate` does with the measurements it takes. Pure numpy; the timing itself is in
trainer/calibrate.py.

Four kinds of timings, each a micro-batch's (or a hop's, or a step's) seconds on one rank:

- ``local``: forward + backward of whole samples on one rank:
  ``c + sum(a*S^2 + (b + a*h)*S) + T*r(T)`` (h = attn_n_half; a whole sample's attention is
  ``a*S^2/eff(S) = a*S^2 + a*h*S``; T = sum(S), the micro-batch's positions; r the size table:
  seconds per position, linear from 0 at T = 0 through one rate per knot, flat beyond the last);
- ``hop``: one ring hop of ``nbytes`` with nothing to overlap: ``L + nbytes / link``;
- ``ring``: forward + backward of a member of a ring of k, each sample split zigzag:
  ``c + sum(a*S^2/k + a*h*S + b*S/k) + n*r(n) + (1 - overlap)*R + max(overlap*R - A, 0)`` with
  ``R = hops(k)*L + comm_passes*(k-1)*n*kv / link``, n the member's positions and A its attention
  (datapipe.plan.cost's module docstring);
- ``step``: a whole optimizer step's time beyond its micro-batches (the slowest rank's step minus
  the slowest rank's micro-batches; ``lengths`` are each rank's micro-batch): ``step``, fitted as
  the median of these timings (it does not depend on the lengths).

The fit runs in three least-squares stages: L and link from the hops (relative residuals, (fit -
measured) / measured: sizes span orders of magnitude); a, b + a*h, c and the size table from the
local timings (non-negative; a coefficient that comes out negative is fixed at 0 and the rest
refitted). The table's knots are the positions of the packed local timings (several samples in one
micro-batch: only they tell T*r(T) from a*S^2), its rates rise from knot to knot by non-negative
steps, so r never falls as T grows: on a CPU the rate climbs where a micro-batch's activations
outgrow a cache and levels off beyond, which one d*T^2 term (the older files' form) could not
follow (it under-predicted 4,096-position micro-batches by 5-10% between 2,048 and 8,192). Then h
(which splits b + a*h into b and a*h: only split samples tell them apart) and overlap from the
rings, by a grid over both and Levenberg-Marquardt from the best point. The compute stages weigh
each residual by 1/measured**0.75 (WEIGHT_POWER), between relative (1.0) and absolute error: steps
are judged relatively from 0.2 s to 30 s, but the default grid holds many more ~2,048-position cases
than 8,192-16,384-position ones, and the model's few terms cannot fit both ends exactly. Refitting
stored calibrations at 0.5, 0.75 and 1.0 against the training-step benchmark's measurements
(benchmarks/bench_costfit.py, with the older d*T^2 term): 1.0 over-predicted long steps by up to
8.6%, 0.5 short ones by up to 15%; the weight moves the worst step by 1-4 points, the calibration run itself by up to 10. Without
hops the link terms are left as given; without rings h = 0 and overlap = 1 (the /1 model). Reported
residuals are relative.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from datapipe.errors import MixlenError
from datapipe.plan.cost import size_rate

KINDS = ("local", "hop", "ring", "step", "tp")
TP_PASSES = 4  # all-reduces per layer under TP: attention and SwiGLU outputs, their inputs' grads
UNRESOLVED_LINK = 1e15  # bytes/s taken when hop times do not grow with the message size


@dataclass(frozen=True)
class Timing:
    """One measurement: `kind` (KINDS), ring size k (1 for local), the micro-batch's sample
    lengths (empty for a hop), bytes per hop (hops only) and seconds."""

    kind: str
    k: int
    lengths: tuple[int, ...]
    nbytes: float
    seconds: float

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "k": self.k,
            "lengths": list(self.lengths),
            "nbytes": self.nbytes,
            "seconds": self.seconds,
        }

    @staticmethod
    def from_dict(d: dict) -> Timing:
        return Timing(
            str(d["kind"]),
            int(d["k"]),
            tuple(int(x) for x in d["lengths"]),
            float(d["nbytes"]),
            float(d["seconds"]),
        )


@dataclass(frozen=True)
class Terms:
    """Fitted values of the cost model's time terms (the byte sizes come from the model shape)."""

    a: float
    b: float
    c: float
    attn_n_half: float
    hop_latency_s: float
    link_bytes_per_s: float
    overlap: float
    size_knots: tuple[float, ...] = ()  # positions T of one rank's micro-batch
    size_rates: tuple[float, ...] = ()  # seconds per position at each knot (cost.size_rate)
    step: float = 0.0  # seconds per optimizer step around its micro-batches
    tp_latency_s: float = 0.0  # per TP all-reduce call (0: no TP timings)
    tp_bytes_per_s: float = 0.0  # the TP group's all-reduce bandwidth


@dataclass
class FitResult:
    """Fitted terms, the fitted time of every timing, and which terms the data determined."""

    terms: Terms
    timings: list[Timing]
    fitted_s: np.ndarray
    fitted_terms: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the data could not resolve

    @property
    def rel_residuals(self) -> np.ndarray:
        t = np.array([m.seconds for m in self.timings])
        return (self.fitted_s - t) / t

    def summary(self) -> dict[str, dict[str, float]]:
        """Per kind: count, RMS and largest relative residual."""
        r = self.rel_residuals
        out = {}
        for kind in KINDS:
            m = np.array([t.kind == kind for t in self.timings], dtype=bool)
            if m.any():
                out[kind] = {
                    "n": int(m.sum()),
                    "rms_rel": float(np.sqrt(np.mean(r[m] ** 2))),
                    "max_abs_rel": float(np.abs(r[m]).max()),
                }
        return out


class CalibrationError(MixlenError):
    """The timings cannot determine a term (e.g. a link too fast to time)."""


@dataclass(frozen=True)
class _Rings:
    """Ring timings as arrays: k, sum S^2, sum S, member positions, seconds."""

    k: np.ndarray
    s2: np.ndarray
    s1: np.ndarray
    n: np.ndarray
    t: np.ndarray


def _rings(timings: Sequence[Timing]) -> _Rings:
    rs = [m for m in timings if m.kind == "ring"]
    k = np.array([m.k for m in rs], dtype=np.float64)
    s2 = np.array([sum(x * x for x in m.lengths) for m in rs], dtype=np.float64)
    s1 = np.array([sum(m.lengths) for m in rs], dtype=np.float64)
    t = np.array([m.seconds for m in rs], dtype=np.float64)
    return _Rings(k, s2, s1, s1 / np.maximum(k, 1), t)


def ring_seconds(
    terms: Terms,
    k: np.ndarray,
    s2: np.ndarray,
    s1: np.ndarray,
    kv_bytes_per_token: float,
    num_layers: int,
    comm_passes: float = 3.0,
) -> np.ndarray:
    """Member time (float seconds) of ring micro-batches: k, sum of S^2 and of S of their samples."""
    k = np.asarray(k, dtype=np.float64)
    attn = terms.a * s2 / k + terms.a * terms.attn_n_half * s1
    n = s1 / k
    lin = terms.b * n + n * size_rate(terms.size_knots, terms.size_rates, n)
    hops = np.where(k > 1, num_layers * (comm_passes * (k - 1) + 1), 0.0)
    nbytes = comm_passes * np.maximum(k - 1, 0) * (s1 / k) * kv_bytes_per_token
    ring = hops * terms.hop_latency_s + nbytes / terms.link_bytes_per_s
    hide = terms.overlap * ring
    return terms.c + attn + lin + (ring - hide) + np.maximum(hide - attn, 0.0)


WEIGHT_POWER = 0.75  # compute stages minimise sum(((fit - t) / t**WEIGHT_POWER)^2)


def nonneg_lstsq(cols: np.ndarray, t: np.ndarray, power: float = 1.0) -> np.ndarray:
    """Coefficients >= 0 minimising sum(((cols @ x) - t) / t**power)^2: Lawson and Hanson's
    active-set method on unit-norm columns (a coefficient set to 0 may come back)."""
    w = 1.0 / t**power
    a = cols * w[:, None]
    norm = np.linalg.norm(a, axis=0)
    norm[norm == 0] = 1.0
    a, b = a / norm, t * w
    n = a.shape[1]
    x, free = np.zeros(n), np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(np.float64).eps * max(a.shape) * max(np.abs(b).max(), 1e-300)
    for _ in range(3 * n + 3):
        grad = a.T @ (b - a @ x)
        if free.all() or grad[~free].max() <= tol:
            break
        free[np.argmax(np.where(free, -np.inf, grad))] = True
        while True:  # solve on the free set; step back to the boundary while any goes <= 0
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            out = np.flatnonzero(free & (z <= 0))
            gap = x[out] - z[out]
            ratio = np.divide(x[out], gap, out=np.zeros_like(gap), where=gap > 0)
            k = int(np.argmin(ratio))
            x = x + ratio[k] * (z - x)
            x[out[k]] = 0.0  # at least one leaves the free set: the loop ends
            free &= x > 0
            x[~free] = 0.0
    return x / norm


def fit_hops(timings: Sequence[Timing], kind: str = "hop") -> tuple[float, float, str | None]:
    """(hop latency s, link bytes/s, note) from hop timings (or the TP all-reduces', `kind` "tp"):
    t = L + nbytes / link. When the times do not grow with the size (a link faster than the
    timings resolve, or a CPU clock that does not see the copies), the link is UNRESOLVED_LINK
    and the note says so."""
    hs = [m for m in timings if m.kind == kind]
    nb = np.array([m.nbytes for m in hs], dtype=np.float64)
    t = np.array([m.seconds for m in hs], dtype=np.float64)
    if len(set(nb.tolist())) < 2:
        raise CalibrationError(f"{kind} timings need at least two message sizes")
    lat, inv_bw = nonneg_lstsq(np.stack([np.ones_like(nb), nb], axis=1), t)
    if not inv_bw > 0:
        lat = float(np.exp(np.mean(np.log(t))))  # geometric mean: the sizes do not matter
        note = (
            f"{kind} times do not grow with the message size: the link is faster than these "
            f"timings resolve (link taken as {UNRESOLVED_LINK:g} B/s; larger --hop-bytes, or "
            "the wall clock, would measure it)"
        )
        return lat, UNRESOLVED_LINK, note
    return float(lat), float(1.0 / inv_bw), None


def size_knots(timings: Sequence[Timing]) -> tuple[float, ...]:
    """The size table's knots: the distinct positions of the local timings that pack several
    samples (what separates T*r(T) from a*S^2); none without packs."""
    return tuple(
        sorted({float(sum(m.lengths)) for m in timings if m.kind == "local" and len(m.lengths) > 1})
    )


def _size_columns(knots: tuple[float, ...], t: np.ndarray) -> list[np.ndarray]:
    """Columns whose non-negative coefficients are the size table's steps from knot to knot:
    rate(T) = sum_j step_j * clip((T - knot_{j-1}) / (knot_j - knot_{j-1}), 0, 1), knot_0 = 0."""
    lo = (0.0, *knots[:-1])
    return [t * np.clip((t - x0) / (x1 - x0), 0.0, 1.0) for x0, x1 in zip(lo, knots)]


def fit_local(
    timings: Sequence[Timing], weight_power: float = WEIGHT_POWER
) -> tuple[float, float, float, tuple[float, ...], tuple[float, ...]]:
    """(a, b + a*h, c, size knots, size rates) from local timings: t = c + sum(a*S^2 + b'*S) +
    T*r(T), T = sum S; no table when no timing packs several samples (then T*r(T) and a*S^2
    cannot be told apart)."""
    ls = [m for m in timings if m.kind == "local"]
    s2 = np.array([sum(x * x for x in m.lengths) for m in ls], dtype=np.float64)
    s1 = np.array([sum(m.lengths) for m in ls], dtype=np.float64)
    t = np.array([m.seconds for m in ls], dtype=np.float64)
    if len(ls) < 3 or len(set(s1.tolist())) < 3:
        raise CalibrationError("local timings need at least 3 distinct lengths to fit a, b, c")
    knots = size_knots(timings)
    cols = np.stack([s2, s1, np.ones_like(s1), *_size_columns(knots, s1)], axis=1)
    if np.linalg.matrix_rank(cols / np.linalg.norm(cols, axis=0)) < cols.shape[1]:
        raise CalibrationError(
            f"local timings: {len(ls)} timings cannot determine the {cols.shape[1]} terms (a, "
            f"b, c and a size rate at each packed size: {[int(k) for k in knots]}); time more "
            "lengths, or more single samples beside the packs"
        )
    a, b1, c, *steps = nonneg_lstsq(cols, t, weight_power)
    rates = tuple(float(x) for x in np.cumsum(steps))
    return float(a), float(b1), float(c), knots, rates


def fit_rings(
    timings: Sequence[Timing],
    a: float,
    b1: float,
    c: float,
    size: tuple[tuple[float, ...], tuple[float, ...]],
    hop_latency_s: float,
    link_bytes_per_s: float,
    kv_bytes_per_token: float,
    num_layers: int,
    comm_passes: float = 3.0,
    weight_power: float = WEIGHT_POWER,
) -> tuple[float, float]:
    """(attn_n_half h, overlap) from ring timings, with a, b' = b + a*h, c and the size table
    (knots, rates) from the local fit:
    a grid over h in [0, b'/a] (b >= 0) and overlap in [0, 1], then Levenberg-Marquardt."""
    r = _rings(timings)
    h_max = b1 / a if a > 0 else 0.0
    scale = max(h_max, 1.0)

    def resid(x: np.ndarray) -> np.ndarray:  # x = (h / scale, overlap)
        h = float(x[0]) * scale
        terms = Terms(a, b1 - a * h, c, h, hop_latency_s, link_bytes_per_s, float(x[1]), *size)
        f = ring_seconds(terms, r.k, r.s2, r.s1, kv_bytes_per_token, num_layers, comm_passes)
        return (f - r.t) / r.t**weight_power

    lo, hi = np.zeros(2), np.array([h_max / scale, 1.0])
    grid = [np.array([h, o]) for h in np.linspace(0, hi[0], 101) for o in np.linspace(0, 1, 51)]
    x = min(grid, key=lambda g: float(np.sum(resid(g) ** 2)))
    # Levenberg-Marquardt from the best grid point (finite-difference Jacobian, box bounds)
    f0, lam = float(np.sum(resid(x) ** 2)), 1e-3
    for _ in range(200):
        r0 = resid(x)
        jac = np.empty((r0.shape[0], 2))
        for i in range(2):
            dx = np.zeros(2)
            dx[i] = 1e-7 if x[i] + 1e-7 <= hi[i] else -1e-7
            jac[:, i] = (resid(x + dx) - r0) / dx[i]
        jtj, jtr = jac.T @ jac, jac.T @ r0
        step = np.linalg.lstsq(jtj + lam * np.diag(np.diag(jtj) + 1e-12), -jtr, rcond=None)[0]
        xn = np.clip(x + step, lo, hi)
        fn = float(np.sum(resid(xn) ** 2))
        if fn < f0:
            done = f0 - fn <= 1e-15 * max(f0, 1e-30) or np.abs(xn - x).max() < 1e-12
            x, f0, lam = xn, fn, max(lam / 10, 1e-12)
            if done:
                break
        else:
            lam *= 10
            if lam > 1e12:
                break
    return float(x[0] * scale), float(x[1])


def fit_terms(
    timings: Sequence[Timing],
    kv_bytes_per_token: float,
    num_layers: int,
    comm_passes: float = 3.0,
    link_bytes_per_s: float | None = None,
    weight_power: float = WEIGHT_POWER,
    tp_bytes_per_token: float = 0.0,
) -> FitResult:
    """Fit every term the timings determine (module docstring); `link_bytes_per_s` is used when
    there are no hop timings; `weight_power`: the compute stages' residual weight 1/t**power.
    With "tp" timings (tensor parallelism; `tp_bytes_per_token`: one all-reduce's bytes per
    position) the TP all-reduce latency and bandwidth come first, the compute terms are fitted
    to the micro-batch times less `tp_seconds`, and b and c get the TP terms back."""
    kinds = {m.kind for m in timings}
    bad = kinds - set(KINDS)
    if bad:
        raise CalibrationError(f"unknown timing kind(s) {sorted(bad)} (known: {KINDS})")
    if any(not (m.seconds > 0 and math.isfinite(m.seconds)) for m in timings):
        raise CalibrationError("every timing must be a positive number of seconds")
    fitted = ["a", "b", "c"]
    notes = []
    lat, bw = 0.0, link_bytes_per_s
    if "hop" in kinds:
        lat, bw, note = fit_hops(timings)
        fitted += ["hop_latency_s"] + ([] if note else ["link_bytes_per_s"])
        notes += [note] if note else []
    if bw is None:
        raise CalibrationError("no hop timings and no link bandwidth given")
    tp_b = tp_c = tp_lat = tp_bw = 0.0
    compute = list(timings)
    if "tp" in kinds:
        tp_lat, tp_bw, note = fit_hops(timings, "tp")
        fitted += ["tp_latency_s"] + ([] if note else ["tp_bytes_per_s"])
        notes += [note] if note else []
        tp_c, tp_b = tp_seconds(num_layers, tp_lat, tp_bw, tp_bytes_per_token)
        compute = [_less_tp(m, tp_c, tp_b) for m in timings]
    a, b1, c, knots, rates = fit_local(compute, weight_power)
    if knots:
        fitted.insert(3, "size_rates")
    h, ov = 0.0, 1.0
    if "ring" in kinds:
        args = (lat, bw, kv_bytes_per_token, num_layers, comm_passes, weight_power)
        h, ov = fit_rings(compute, a, b1, c, (knots, rates), *args)
        fitted += ["attn_n_half", "overlap"]
    # h may sit at its bound b'/a, where b' - a*h rounds to a tiny negative number
    step = 0.0
    if "step" in kinds:
        step = float(np.median([m.seconds for m in timings if m.kind == "step"]))
        fitted.append("step")
    b = max(b1 - a * h, 0.0) + tp_b
    terms = Terms(a, b, c + tp_c, h, lat, bw, ov, knots, rates, step, tp_lat, tp_bw)
    fit_s = predict(terms, timings, kv_bytes_per_token, num_layers, comm_passes)
    return FitResult(terms, list(timings), fit_s, fitted, notes)


def tp_seconds(
    num_layers: int, latency_s: float, bytes_per_s: float, bytes_per_token: float
) -> tuple[float, float]:
    """(seconds per micro-batch, seconds per position) of a micro-batch's TP all-reduces:
    TP_PASSES per layer, each of `bytes_per_token` per position of the process's share."""
    calls = TP_PASSES * num_layers
    return calls * latency_s, calls * bytes_per_token / bytes_per_s


def _less_tp(m: Timing, per_mb: float, per_pos: float) -> Timing:
    """A micro-batch timing less its TP all-reduces (a member's positions: sum S / k)."""
    if m.kind not in ("local", "ring"):
        return m
    left = m.seconds - per_mb - per_pos * sum(m.lengths) / m.k
    return dataclasses.replace(m, seconds=max(left, 0.05 * m.seconds))


def predict(
    terms: Terms,
    timings: Sequence[Timing],
    kv_bytes_per_token: float,
    num_layers: int,
    comm_passes: float = 3.0,
) -> np.ndarray:
    """The model's seconds for each timing (local, hop or ring)."""
    out = np.empty(len(timings))
    for i, m in enumerate(timings):
        if m.kind == "hop":
            out[i] = terms.hop_latency_s + m.nbytes / terms.link_bytes_per_s
            continue
        if m.kind == "tp":
            out[i] = terms.tp_latency_s + m.nbytes / terms.tp_bytes_per_s
            continue
        if m.kind == "step":
            out[i] = terms.step
            continue
        s = np.asarray(m.lengths, dtype=np.float64)
        out[i] = ring_seconds(
            terms,
            np.array([float(m.k)]),
            np.array([float((s * s).sum())]),
            np.array([float(s.sum())]),
            kv_bytes_per_token,
            num_layers,
            comm_passes,
        )[0]
    return out
