"""Figures over seeds: mean, sample standard deviation, Student's t-interval, paired differences.

A comparison has few seeds (three to five in the papers), which shapes every choice here:
the spread is the sample standard deviation (ddof = 1; the population formula understates
it by a factor sqrt((n - 1) / n), 0.82 at three seeds), and the interval uses Student's t
with n - 1 degrees of freedom, not the normal's 1.96 (t(0.975, 2) = 4.30). With one seed
there is no spread to measure, so the spread and the interval are NaN and tables say n/a.

Two methods run with the same seed see the same partition and the same client sequence,
so the seed's own luck is shared; the difference per seed cancels it, where the two
methods' intervals set side by side keep it (and overlap even when one method is better on
every seed).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

from scipy import stats as _scipy_stats

CONFIDENCE = 0.95
NA = "n/a"


@dataclass(frozen=True)
class Estimate:
    """The mean of ``n`` values, their sample standard deviation and the half-width of a
    t-interval for the mean (both NaN with fewer than two values)."""

    n: int
    mean: float
    sd: float
    half_width: float
    confidence: float = CONFIDENCE

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    @property
    def has_spread(self) -> bool:
        return self.n >= 2


def _finite(values: Iterable[float | None]) -> list[float]:
    # a figure a run does not have (None, or NaN read back from a CSV) is left out rather
    # than counted as a zero
    out = []
    for v in values:
        if v is None:
            continue
        x = float(v)
        if math.isfinite(x):
            out.append(x)
    return out


def t_quantile(confidence: float, dof: int) -> float:
    """The two-sided Student's t quantile: t(1 - (1 - confidence) / 2, dof)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence {confidence!r} must lie strictly between 0 and 1")
    if dof < 1:
        raise ValueError(f"a t quantile needs at least 1 degree of freedom, got {dof}")
    return float(_scipy_stats.t.ppf(0.5 + confidence / 2, dof))


def estimate(values: Iterable[float | None], confidence: float = CONFIDENCE) -> Estimate:
    """Mean, sample standard deviation (ddof = 1) and t-interval of the finite values."""
    xs = _finite(values)
    n = len(xs)
    if n == 0:
        return Estimate(0, math.nan, math.nan, math.nan, confidence)
    # statistics' exact rational arithmetic: equal values have a spread of exactly 0
    mean = statistics.mean(xs)
    if n == 1:
        return Estimate(1, mean, math.nan, math.nan, confidence)
    sd = statistics.stdev(xs, mean)
    return Estimate(n, mean, sd, t_quantile(confidence, n - 1) * sd / math.sqrt(n), confidence)


def paired_differences(values: Mapping[Hashable, float | None],
                       reference: Mapping[Hashable, float | None]) -> dict[Hashable, float]:
    """``values[k] - reference[k]`` for every key (a seed) where both are finite numbers,
    in the order of ``values``."""
    out = {}
    for key, v in values.items():
        r = reference.get(key)
        if _finite([v]) and _finite([r]):
            out[key] = float(v) - float(r)  # type: ignore[arg-type]
    return out


def paired_estimate(values: Mapping[Hashable, float | None],
                    reference: Mapping[Hashable, float | None],
                    confidence: float = CONFIDENCE) -> Estimate:
    """The mean per-key difference against ``reference`` and its t-interval."""
    return estimate(paired_differences(values, reference).values(), confidence)


# -- as table cells -----------------------------------------------------------------------
def mean_sd_text(est: Estimate, scale: float = 1.0, digits: int = 2) -> str:
    """``mean ± sd``, or the mean alone with one value (a spread of one seed would read as
    a measured zero); ``n/a`` with none."""
    if est.n == 0:
        return NA
    text = f"{est.mean * scale:.{digits}f}"
    return text + (f" ± {est.sd * scale:.{digits}f}" if est.has_spread else "")


def interval_text(est: Estimate, scale: float = 1.0, digits: int = 2, signed: bool = False) -> str:
    """``[low, high]``, or ``n/a`` where one value gives no interval."""
    if not est.has_spread:
        return NA
    sign = "+" if signed else ""
    return f"[{est.low * scale:{sign}.{digits}f}, {est.high * scale:{sign}.{digits}f}]"


def mean_text(est: Estimate, scale: float = 1.0, digits: int = 2, signed: bool = False) -> str:
    if est.n == 0:
        return NA
    return f"{est.mean * scale:{'+' if signed else ''}.{digits}f}"


def columns(prefix: str, est: Estimate) -> dict[str, float]:
    """CSV columns ``<prefix>_mean``, ``_sd``, ``_ci_low``, ``_ci_high`` (NaN, written as an
    empty cell, where one value has no spread)."""
    return {f"{prefix}_mean": est.mean, f"{prefix}_sd": est.sd,
            f"{prefix}_ci_low": est.low, f"{prefix}_ci_high": est.high}


def column_names(prefix: str) -> list[str]:
    return [f"{prefix}_{k}" for k in ("mean", "sd", "ci_low", "ci_high")]
