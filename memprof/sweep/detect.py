"""Finding "less budget, more memory" in a measured curve (pure; no torch).

A pair (a, b) with budget a < b is non-monotone when a's peak exceeds b's by more than the
noise: `max(abs_tol, rel_tol * peak_b)`. Defaults follow the measured spread of one plan across
processes on the H200 (seed paper §2: at most 1.5 MB, 0.3%; memprof's remat grid: 2.5 MB on a
190 MB peak), so a flag is a real difference in plans, not a rerun's noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ABS_TOL = 1_500_000  # bytes
REL_TOL = 0.005
# the absolute floor scales down with the peaks: a fixed 1.5 MB hid a +34% bump between the bundled
# example's 0.6 MB step peaks on the CPU; floors below it are this share of the smallest peak
AUTO_SHARE = 0.02


def auto_floor(peaks: Sequence[int | None]) -> int:
    """The absolute noise floor for these peaks: ABS_TOL, or AUTO_SHARE of the smallest peak where
    that is less (the H200's measured spread of one plan, 2.5 MB on 190 MB, stays under both)."""
    known = [p for p in peaks if p]
    return min(ABS_TOL, int(AUTO_SHARE * min(known))) if known else ABS_TOL


@dataclass(frozen=True)
class Flag:
    """Less budget, more memory: `low`'s peak exceeds `high`'s (budgets low < high) beyond noise."""

    low: float
    high: float
    low_peak: int
    high_peak: int

    @property
    def excess(self) -> int:
        return self.low_peak - self.high_peak

    @property
    def ratio(self) -> float:
        return self.low_peak / self.high_peak if self.high_peak else float("inf")


def tolerance(peak: int, abs_tol: int = ABS_TOL, rel_tol: float = REL_TOL) -> int:
    return max(int(abs_tol), int(rel_tol * peak))


def non_monotone(points: Sequence[tuple[float, int | None]], abs_tol: int = ABS_TOL,
                 rel_tol: float = REL_TOL) -> list[Flag]:
    """Every non-monotone pair of (budget, peak) points; points without a peak are skipped.

    Sorted by the low budget, then by the excess (largest first)."""
    pts = sorted((b, p) for b, p in points if p is not None)
    flags = [
        Flag(a, b, pa, pb)
        for i, (a, pa) in enumerate(pts)
        for b, pb in pts[i + 1:]
        if b > a and pa - pb > tolerance(pb, abs_tol, rel_tol)
    ]
    flags.sort(key=lambda f: (f.low, -f.excess))
    return flags


def worst_per_budget(flags: Sequence[Flag]) -> list[Flag]:
    """For each flagged low budget, the pair with the largest excess (what the table shows)."""
    best: dict[float, Flag] = {}
    for f in flags:
        if f.low not in best or f.excess > best[f.low].excess:
            best[f.low] = f
    return [best[b] for b in sorted(best)]


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None with fewer than 3 points or no spread."""
    if len(xs) != len(ys) or len(xs) < 3:
        return None

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return float(sxy / (sxx * syy) ** 0.5)
