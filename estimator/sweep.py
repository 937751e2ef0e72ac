"""Vectorised estimates over batch x seq grids: 100,000 configs in well under a second, with no formula copied.

For fixed everything-but-(batch, seq), every moment `estimate` maximises over (estimate.moments: each stage of
each pipeline stage, every backward candidate) is, in the estimator as written,

    T(b, s) = A(s) + (b - b0) * G(s),   A and G polynomials of degree <= 2 in s,

because every term is a constant (weights, gradients, states, overhead), linear in b (prefill logits), linear in
b*s (saved activations, KV cache) or in b*s^2 (eager attention scores). So `estimate` is evaluated exactly at
three seqs x two batches, A and G are interpolated in exact rational arithmetic, and the polynomials are
evaluated on the whole array; the step's peak is the elementwise max over moments, which handles the branches
estimate() chooses with max() (backward start vs end, first vs last pipeline stage, the peak stage) exactly.

Two max()es sit INSIDE a moment and bend it in s: eager prefill (attention scores vs MLP intermediates) and
full checkpointing (logits' gradients vs one recomputed layer). Each is s * max of two polynomials, so T has
at most one kink in s. The fit is therefore accepted only if it reproduces estimate() TO THE BYTE at up to eight
more grid seqs, strictly inside both fitted intervals (chosen by value and by rank), and at a middle batch.
A kink between the fitted seqs always fails that: on the side where two fitted seqs share a piece, the fit
minus the curve is a nonzero quadratic whose only roots are those two seqs, and on the other side the two
pieces cannot agree at two seqs. A group that fails (a kink, or an estimate() that rounds floats, see below)
falls back to a per-seq fit: T is linear in b at each seq, taken from two exact batches and checked at a middle
one; a seq that fails even that is evaluated point by point with estimate().

Exactness: where estimate() does integer arithmetic only, sweep == estimate exactly. A few terms round a float
to int (KV cache and weights scaled by tp/pp fractions, the seeds' k form, checkpointed residuals under
sequence parallelism); those groups take the per-seq path, and interpolating in b between values each < 1 byte
off their line keeps the result within ROUNDING_TOL_BYTES of estimate() (tests/test_search.py checks it).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction

import numpy as np

from estimator.estimate import Options, estimate, moments
from estimator.model import ModelSpec
from estimator.spec import MAX_BATCH, MAX_SEQ, Parallel, Workload

# A per-seq line in b is accepted when its middle check is within this many bytes of estimate(); results of
# groups whose estimate() rounds floats are within it too (interpolating values each < 1 byte off).
ROUNDING_TOL_BYTES = 4


@dataclass(frozen=True)
class SweepResult:
    """Per-GPU step peak for every (workload, parallel, batch, seq) of a grid."""

    total_bytes: np.ndarray   # int64, shape (len(workloads), len(parallels), len(batches), len(seqs))
    batches: np.ndarray       # int64, the batch axis
    seqs: np.ndarray          # int64, the seq axis
    estimate_calls: int       # exact estimate()/moments() evaluations spent
    fallback_points: int      # points evaluated one by one because no polynomial fitted


def _check_axis(name: str, values, hi: int) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu" and not (arr.dtype.kind == "f" and np.all(arr == np.floor(arr))):
        raise ValueError(f"{name}: must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and (arr.min() < 1 or arr.max() > hi):
        raise ValueError(f"{name}: values must lie in 1..{hi}, got {arr.min()}..{arr.max()}")
    return arr


def _lagrange(xs: list[int], ys: list[Fraction]) -> list[Fraction]:
    """Coefficients (c0, c1, ..) of the polynomial through the points (xs, ys), exactly."""
    n = len(xs)
    coeffs = [Fraction(0)] * n
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        basis = [Fraction(1)]  # prod_{j != i} (x - xj) / (xi - xj), built up coefficient by coefficient
        for j, xj in enumerate(xs):
            if j == i:
                continue
            d = Fraction(1, xi - xj)
            basis = [(basis[k - 1] if k else 0) * d - (basis[k] * xj * d if k < len(basis) else 0)
                     for k in range(len(basis) + 1)]
        for k, c in enumerate(basis):
            coeffs[k] += yi * c
    return coeffs


def _poly(coeffs: list[Fraction], x):
    out = 0.0
    for c in reversed(coeffs):
        out = out * x + float(c)
    return out


class _Group:
    """One (model, workload minus batch/seq, parallel, options): evaluates moments with caching."""

    def __init__(self, model: ModelSpec, workload: Workload, parallel: Parallel, options: Options):
        self.model, self.workload, self.parallel, self.options = model, workload, parallel, options
        self.cache: dict[tuple[int, int], tuple[int, ...]] = {}
        self.names = None

    def totals(self, b: int, s: int) -> tuple[int, ...]:
        """Total bytes of every moment at (b, s)."""
        key = (b, s)
        if key not in self.cache:
            ms = moments(self.model, replace(self.workload, batch=b, seq=s), self.parallel, self.options)
            names = tuple((p, n) for p, n, _ in ms)
            if self.names is None:
                self.names = names
            elif names != self.names:  # the set of moments changed with (b, s): no common polynomial
                raise _NotPolynomial
            self.cache[key] = tuple(bd.total for _, _, bd in ms)
        return self.cache[key]


class _NotPolynomial(Exception):
    pass


def _close(predicted: np.ndarray, exact: tuple[int, ...], tol: float) -> bool:
    return bool(np.all(np.abs(predicted - np.asarray(exact, dtype=np.float64)) <= tol))


def _nearest_inside(us: np.ndarray, target: float, lo: int, hi: int) -> int | None:
    """The grid seq strictly between lo and hi closest to target (None if there is none)."""
    inside = us[(us > lo) & (us < hi)]
    return None if inside.size == 0 else int(inside[np.argmin(np.abs(inside - target))])


def _seq_nodes(us: np.ndarray) -> tuple[list[int], list[int]]:
    """Three fit seqs (ends + the one nearest the middle by value, which keeps the interpolation's error
    amplification small) and check seqs strictly inside both intervals: by value (quarters, middle) and by rank
    (the median grid point), so clustered grids are checked where their points are."""
    lo, hi = int(us[0]), int(us[-1])
    mid = _nearest_inside(us, (lo + hi) / 2, lo, hi)
    checks = set()
    for a, b in ((lo, mid), (mid, hi)):
        for frac in (0.25, 0.5, 0.75):
            checks.add(_nearest_inside(us, a + frac * (b - a), a, b))
        inside = us[(us > a) & (us < b)]
        if inside.size:
            checks.add(int(inside[inside.size // 2]))
    return [lo, mid, hi], sorted(c for c in checks if c is not None)


def _fit_2d(g: _Group, bs: np.ndarray, ss: np.ndarray) -> np.ndarray:
    """Peak per point from polynomials in s (3 seqs) x linear in b (2 batches), verified; raises _NotPolynomial."""
    ub, us = np.unique(bs), np.unique(ss)
    s_fit, s_check = _seq_nodes(us)
    b_fit = [int(ub[0])] + ([int(ub[-1])] if len(ub) > 1 else [])
    a_coef, g_coef = _fit_moments(g, b_fit, s_fit)
    b0 = b_fit[0]
    checks = [(b, s) for b in b_fit for s in s_check]
    if len(ub) > 2:
        checks += [(int(ub[len(ub) // 2]), s) for s in (s_fit[0], s_fit[-1])]
    for b, s in checks:
        pred = np.array([_poly(a, s) + (b - b0) * _poly(gc, s) for a, gc in zip(a_coef, g_coef)])
        if not _close(pred, g.totals(b, s), 0):  # exact or not at all: see the module docstring
            raise _NotPolynomial
    bf, sf = bs.astype(np.float64), ss.astype(np.float64)
    peak = None
    for a, gc in zip(a_coef, g_coef):
        val = _poly(a, sf) + (bf - b0) * _poly(gc, sf)
        peak = val if peak is None else np.maximum(peak, val)
    return peak


def _fit_moments(g: _Group, b_fit: list[int], s_fit: list[int]):
    """Per moment: coefficients of A(s) = T(b0, s) and G(s) = (T(b1, s) - T(b0, s)) / (b1 - b0)."""
    rows0 = [g.totals(b_fit[0], s) for s in s_fit]
    rows1 = [g.totals(b_fit[1], s) for s in s_fit] if len(b_fit) > 1 else None
    a_coef, g_coef = [], []
    for m in range(len(rows0[0])):
        a_coef.append(_lagrange(s_fit, [Fraction(r[m]) for r in rows0]))
        if rows1 is None:
            g_coef.append([Fraction(0)])
        else:
            slope = [Fraction(r1[m] - r0[m], b_fit[1] - b_fit[0]) for r0, r1 in zip(rows0, rows1)]
            g_coef.append(_lagrange(s_fit, slope))
    return a_coef, g_coef


def _per_seq(g: _Group, bs: np.ndarray, ss: np.ndarray, out: np.ndarray) -> int:
    """Exact per-seq fits, linear in b, verified at a middle batch; scalar estimate() where that fails.
    Fills `out` and returns the number of points evaluated one by one."""
    fallback = 0
    for s in np.unique(ss):
        sel = ss == s
        ub = np.unique(bs[sel])
        b0, b1 = int(ub[0]), int(ub[-1])
        t0, t1 = np.array(g.totals(b0, int(s)), dtype=np.float64), np.array(g.totals(b1, int(s)), dtype=np.float64)
        slope = (t1 - t0) / (b1 - b0) if b1 > b0 else np.zeros_like(t0)
        ok = True
        if len(ub) > 2:
            bm = int(ub[len(ub) // 2])
            ok = _close(t0 + (bm - b0) * slope, g.totals(bm, int(s)), ROUNDING_TOL_BYTES)
        if ok:
            out[sel] = np.max(t0[:, None] + np.outer(slope, bs[sel] - b0), axis=0)
        else:
            idx = np.nonzero(sel)[0]
            for i in idx:
                out[i] = estimate(g.model, replace(g.workload, batch=int(bs[i]), seq=int(s)), g.parallel,
                                  g.options).total_bytes
            fallback += len(idx)
    return fallback


def sweep_points(model: ModelSpec, workload: Workload, batch, seq, parallel: Parallel = Parallel(),
                 options: Options = Options(), _stats: list | None = None) -> np.ndarray:
    """estimate(model, replace(workload, batch=b, seq=s), parallel, options).total_bytes for every (b, s) pair
    of the equal-length arrays `batch` and `seq` (the workload's own batch/seq are ignored), as int64."""
    bs = _check_axis("batch", batch, MAX_BATCH).ravel()
    ss = _check_axis("seq", seq, MAX_SEQ).ravel()
    if bs.shape != ss.shape:
        raise ValueError(f"batch: {bs.size} values but seq has {ss.size}; give one seq per batch")
    if bs.size == 0:
        return np.zeros(0, dtype=np.int64)
    g = _Group(model, workload, parallel, options)
    out = np.zeros(bs.size, dtype=np.float64)
    fallback = 0
    try:
        if len(np.unique(ss)) < 5:  # too few seqs to fit and verify a quadratic: fit per seq instead
            raise _NotPolynomial
        out = _fit_2d(g, bs, ss)
    except _NotPolynomial:
        try:
            fallback = _per_seq(g, bs, ss, out)
        except _NotPolynomial:
            out = np.array([estimate(model, replace(workload, batch=int(b), seq=int(s)), parallel,
                                     options).total_bytes for b, s in zip(bs, ss)], dtype=np.float64)
            fallback = bs.size
    if _stats is not None:
        _stats.append((len(g.cache), fallback))
    return np.rint(out).astype(np.int64)


def sweep(model: ModelSpec, workloads, parallels, batches, seqs, options: Options = Options()) -> SweepResult:
    """Step peak per GPU over the grid workloads x parallels x batches x seqs (batch and seq of each
    workload are replaced by the axes). One polynomial fit per (workload, parallel)."""
    workloads, parallels = list(workloads), list(parallels)
    b_axis = _check_axis("batches", batches, MAX_BATCH).ravel()
    s_axis = _check_axis("seqs", seqs, MAX_SEQ).ravel()
    bb, sg = np.meshgrid(b_axis, s_axis, indexing="ij")
    total = np.zeros((len(workloads), len(parallels), b_axis.size, s_axis.size), dtype=np.int64)
    stats: list = []
    for i, w in enumerate(workloads):
        for j, p in enumerate(parallels):
            total[i, j] = sweep_points(model, w, bb.ravel(), sg.ravel(), p, options, stats).reshape(bb.shape)
    return SweepResult(total_bytes=total, batches=b_axis, seqs=s_axis,
                       estimate_calls=sum(c for c, _ in stats), fallback_points=sum(f for _, f in stats))
