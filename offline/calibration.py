"""Regression math for calibrating the activation constant k and the allocator/context residual.

Two least-squares fits, both plain NumPy (scipy is imported lazily, only for the t quantile):

1. `fit_k`: OLS through the origin of y = k * x, where x = b*s*h*L*bytes and y = the activation bytes of a run
   (see bench/accuracy/calibrate.py for how x and y come out of a run row). Through the origin because zero tokens save
   zero activations; an intercept would soak up whatever the non-activation terms got wrong.
2. `fit_residual`: ordinary OLS with intercept of the measured device total on the analytic allocated peak,
       total_measured = (1 + alpha) * analytic_allocated + context_bytes,
   alpha being the allocator's proportional slack (block rounding, fragmentation) and context_bytes the fixed
   part torch never allocates (CUDA context, kernel images, cuBLAS handles).

Formulas: Montgomery, Peck & Vining, "Introduction to Linear Regression Analysis", 5th ed. (Wiley 2012),
sec. 2.2-2.5 (least squares, interval estimation, prediction of new observations, simple regression) and
sec. 2.10 (regression through the origin). docs/calibration.md writes them out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from estimator.calibration_file import SEED_K  # noqa: F401  (the fits start from it; one definition)

LEVEL = 0.95  # confidence level of every interval here


def t_quantile(p: float, df: int) -> float:
    """Quantile p of Student's t with df degrees of freedom (scipy, imported here to keep `estimator` light)."""
    from scipy.stats import t  # noqa: PLC0415  lazy: importing scipy costs ~0.3 s

    return float(t.ppf(p, df))


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level: {level!r} must lie strictly between 0 and 1, e.g. 0.95")


def _as_arrays(x, y) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, dtype=np.float64).ravel()
    y = np.asarray(y, dtype=np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f"x: {x.size} values but y has {y.size}; give one y per x")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("x: every x and y must be a finite number")
    return x, y


@dataclass(frozen=True)
class KFit:
    """y = k * x fitted through the origin by least squares (MPV sec. 2.10)."""

    k: float                  # slope: sum(x*y) / sum(x^2)
    k_ci_low: float           # k - t * se_k, t = t_{(1+level)/2, n-1}
    k_ci_high: float          # k + t * se_k
    se_k: float               # standard error of k: s / sqrt(sum x^2)
    r2: float                 # UNCENTERED R^2 = sum(yhat^2) / sum(y^2): the through-origin definition, not
                              # comparable with the centered R^2 of a fit with an intercept (MPV sec. 2.10)
    residual_std_bytes: float  # s = sqrt(SSE / (n - 1)), the standard error of the regression, in y's units
    n_points: int
    sum_x2: float             # sum of x^2; with s it gives every interval at a new x
    t_value: float            # the t quantile used for the intervals
    level: float = LEVEL

    def __post_init__(self) -> None:
        if self.n_points < 2:
            raise ValueError(f"n_points: {self.n_points}; a through-origin fit with an interval needs >= 2")
        if not self.k_ci_low <= self.k <= self.k_ci_high:
            raise ValueError(f"k_ci_low: interval [{self.k_ci_low}, {self.k_ci_high}] must contain k={self.k}")

    def predict(self, x0: float) -> float:
        return self.k * x0

    def mean_interval(self, x0: float) -> tuple[float, float]:
        """Confidence interval of the mean response at x0: k*x0 -/+ t * s * |x0| / sqrt(sum x^2)."""
        half = self.t_value * self.residual_std_bytes * abs(x0) / math.sqrt(self.sum_x2)
        return self.k * x0 - half, self.k * x0 + half

    def prediction_interval(self, x0: float) -> tuple[float, float]:
        """Interval for ONE new observation at x0: k*x0 -/+ t * s * sqrt(1 + x0^2 / sum x^2) (MPV sec. 2.10)."""
        half = self.t_value * self.residual_std_bytes * math.sqrt(1.0 + x0 * x0 / self.sum_x2)
        return self.k * x0 - half, self.k * x0 + half


def fit_k(x, y, level: float = LEVEL) -> KFit:
    """Least-squares k of y = k*x (no intercept) with its `level` confidence interval.

    x, y: equal-length sequences, x > 0 (bytes). Needs at least two points: with n - 1 = 0 degrees of freedom
    there is no residual variance and so no interval.
    """
    _check_level(level)
    x, y = _as_arrays(x, y)
    n = x.size
    if n < 2:
        raise ValueError(f"points: {n} usable point(s); a through-origin fit with an interval needs at least 2")
    if np.any(x <= 0):
        raise ValueError("x: every x = b*s*h*L*bytes must be > 0")
    # Work in units of the largest x: sums of squares of ~1e10-byte values stay well inside float64 either way,
    # but unit-scale numbers make an exact (noise-free) fit come back exact to the last bits.
    scale = float(x.max())
    xs, ys = x / scale, y / scale
    sxx = float(np.dot(xs, xs))
    k = float(np.dot(xs, ys)) / sxx
    resid = ys - k * xs
    sse = float(np.dot(resid, resid))
    s = math.sqrt(sse / (n - 1))
    se_k = s / math.sqrt(sxx)
    syy = float(np.dot(ys, ys))
    r2 = (k * k * sxx) / syy if syy > 0 else 1.0
    t = t_quantile(0.5 + level / 2, n - 1)
    return KFit(k=k, k_ci_low=k - t * se_k, k_ci_high=k + t * se_k, se_k=se_k, r2=min(r2, 1.0),
                residual_std_bytes=s * scale, n_points=n, sum_x2=sxx * scale * scale, t_value=t, level=level)


@dataclass(frozen=True)
class ResidualFit:
    """total_measured = (1 + alpha) * analytic_allocated + context_bytes, by OLS with intercept (MPV sec. 2.2-2.4)."""

    alpha: float              # proportional excess of the device total over the analytic allocated bytes
    alpha_ci_low: float
    alpha_ci_high: float
    context_bytes: float      # intercept: bytes in use at zero allocation (context, kernels, handles)
    context_ci_low: float
    context_ci_high: float
    r2: float                 # ordinary (centered) R^2 = 1 - SSE / Syy, since this fit has an intercept
    residual_std_bytes: float  # s = sqrt(SSE / (n - 2))
    n_points: int
    level: float = LEVEL

    def predict(self, analytic_allocated_bytes: float) -> float:
        return (1.0 + self.alpha) * analytic_allocated_bytes + self.context_bytes


def fit_residual(analytic_allocated, total_measured, level: float = LEVEL) -> ResidualFit:
    """Fit alpha and the context constant from (analytic allocated, measured total) pairs, in bytes.

    Simple linear regression: slope b1 = Sxy / Sxx, intercept b0 = ybar - b1 * xbar, MSE = SSE / (n - 2),
    se(b1) = sqrt(MSE / Sxx), se(b0) = sqrt(MSE * (1/n + xbar^2 / Sxx)) (MPV sec. 2.2 and 2.4.1).
    Needs at least 3 points and two different analytic values.
    """
    _check_level(level)
    x, y = _as_arrays(analytic_allocated, total_measured)
    n = x.size
    if n < 3:
        raise ValueError(f"points: {n} usable point(s); slope + intercept with intervals need at least 3")
    xbar, ybar = float(x.mean()), float(y.mean())
    dx, dy = x - xbar, y - ybar
    sxx = float(np.dot(dx, dx))
    if sxx <= 0:
        raise ValueError("analytic_allocated: all points have the same analytic peak; the slope is undefined")
    b1 = float(np.dot(dx, dy)) / sxx
    b0 = ybar - b1 * xbar
    resid = y - (b0 + b1 * x)
    sse = float(np.dot(resid, resid))
    mse = sse / (n - 2)
    syy = float(np.dot(dy, dy))
    t = t_quantile(0.5 + level / 2, n - 2)
    se_b1 = math.sqrt(mse / sxx)
    se_b0 = math.sqrt(mse * (1.0 / n + xbar * xbar / sxx))
    return ResidualFit(alpha=b1 - 1.0, alpha_ci_low=b1 - 1.0 - t * se_b1, alpha_ci_high=b1 - 1.0 + t * se_b1,
                       context_bytes=b0, context_ci_low=b0 - t * se_b0, context_ci_high=b0 + t * se_b0,
                       r2=1.0 - sse / syy if syy > 0 else 1.0, residual_std_bytes=math.sqrt(mse),
                       n_points=n, level=level)
