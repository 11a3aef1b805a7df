"""Exact min-max integer splits: layers over stages, micro-batches over data-parallel groups.

Both problems have the same form: give `total` identical units to parts whose time is
`count * unit_cost + fixed_cost`, each count within [lo, hi], minimizing the slowest part.
Bisection on the bottleneck T gives the largest count each part can take within T; the
smallest feasible T is optimal, and the few surplus units come off the parts nearest T.
"""

from __future__ import annotations

import bisect

import numpy as np

from resihp_jax.errors import PlanError

_BISECT_STEPS = 64
_MAX_BREAKPOINTS = 100_000


def min_max_split(total: int, unit_cost_P: np.ndarray, fixed_cost_P: np.ndarray | None = None,
                  *, lo: int = 1, hi_P: np.ndarray | None = None,
                  what: str = "units") -> np.ndarray:
    """Counts (sum `total`, each in [lo, hi]) minimizing max(count * unit + fixed)."""
    unit_P = np.asarray(unit_cost_P, dtype=np.float64)
    n_parts = unit_P.shape[0]
    fixed_P = np.zeros(n_parts) if fixed_cost_P is None else np.asarray(fixed_cost_P, float)
    hi_P = np.full(n_parts, total, np.int64) if hi_P is None else np.asarray(hi_P, np.int64)
    _check_feasible(total, n_parts, lo, hi_P, what)
    if not np.all(np.isfinite(unit_P)) or np.any(unit_P <= 0):
        raise PlanError(f"cannot split {what}: every part needs a finite positive unit cost")
    t_best = _optimal_bottleneck(total, unit_P, fixed_P, lo, hi_P)
    counts_P = _counts_at(t_best, unit_P, fixed_P, lo, hi_P)
    return _remove_surplus(counts_P, int(counts_P.sum()) - total, unit_P, fixed_P, lo)


def _optimal_bottleneck(total: int, unit_P: np.ndarray, fixed_P: np.ndarray, lo: int,
                        hi_P: np.ndarray) -> float:
    """Smallest T whose per-part maximal counts reach `total`."""
    t_min = float(np.max(lo * unit_P + fixed_P))
    if _counts_at(t_min, unit_P, fixed_P, lo, hi_P).sum() >= total:
        return t_min
    t_lo, t_hi = _bracket(total, unit_P, fixed_P, lo, hi_P, t_min)
    breaks = _breakpoints(t_lo, t_hi, unit_P, fixed_P, lo, hi_P)
    if breaks is None:  # too many to list: bisect instead
        for _ in range(_BISECT_STEPS):
            mid = 0.5 * (t_lo + t_hi)
            if _counts_at(mid, unit_P, fixed_P, lo, hi_P).sum() >= total:
                t_hi = mid
            else:
                t_lo = mid
        return t_hi
    # the answer is a breakpoint in (t_lo, t_hi]: the first feasible one, else the last
    first = bisect.bisect_left(breaks[:-1], True, key=lambda t: bool(
        _counts_at(float(t), unit_P, fixed_P, lo, hi_P).sum() >= total))
    return float(breaks[first])


def _bracket(total: int, unit_P: np.ndarray, fixed_P: np.ndarray, lo: int, hi_P: np.ndarray,
             t_min: float) -> tuple[float, float]:
    """(infeasible, feasible) bottlenecks around the optimum, narrow in the common case.

    Ignoring bounds, the continuous optimum t_c has parts summing to exactly `total`; the
    integer optimum lies within one unit cost of it.
    """
    inv_P = 1.0 / unit_P
    t_c = (total + float((fixed_P * inv_P).sum())) / float(inv_P.sum())
    t_max = float(np.max(hi_P * unit_P + fixed_P))
    t_lo = max(t_c - 0.5 * float(unit_P.min()), t_min)
    if _counts_at(t_lo, unit_P, fixed_P, lo, hi_P).sum() >= total:
        t_lo = t_min
    t_hi = min(t_c + float(unit_P.max()), t_max)
    while _counts_at(t_hi, unit_P, fixed_P, lo, hi_P).sum() < total:
        t_hi = min(t_hi + 2.0 * (t_hi - t_lo), t_max)
    return t_lo, t_hi


def _breakpoints(t_lo: float, t_hi: float, unit_P: np.ndarray, fixed_P: np.ndarray, lo: int,
                 hi_P: np.ndarray) -> np.ndarray | None:
    """Sorted distinct part times k * unit + fixed in (t_lo, t_hi]; None if too many."""
    k_first = np.clip(np.floor((t_lo - fixed_P) / unit_P) + 1, lo, hi_P).astype(np.int64)
    k_last = np.clip(np.floor((t_hi * (1 + 1e-12) - fixed_P) / unit_P), lo, hi_P)
    n_P = np.maximum(k_last.astype(np.int64) - k_first + 1, 0)
    n_total = int(n_P.sum())
    if n_total > _MAX_BREAKPOINTS:
        return None
    part = np.repeat(np.arange(unit_P.shape[0]), n_P)
    step = np.arange(n_total) - np.repeat(np.cumsum(n_P) - n_P, n_P)
    times = (k_first[part] + step) * unit_P[part] + fixed_P[part]
    return np.unique(times[(times > t_lo) & (times <= t_hi * (1 + 1e-12))])


def _check_feasible(total: int, n_parts: int, lo: int, hi_P: np.ndarray, what: str) -> None:
    if n_parts < 1 or total < lo * n_parts:
        raise PlanError(f"cannot split {total} {what} over {n_parts} parts with at least {lo} "
                        "each")
    if int(hi_P.sum()) < total:
        raise PlanError(f"cannot split {total} {what} over {n_parts} parts: memory allows at "
                        f"most {int(hi_P.sum())} in total (per-part caps {hi_P.tolist()[:8]}"
                        f"{'...' if n_parts > 8 else ''})")


def _counts_at(t: float, unit_P: np.ndarray, fixed_P: np.ndarray, lo: int,
               hi_P: np.ndarray) -> np.ndarray:
    # Relative slack keeps a part whose time equals t exactly from flickering out by rounding.
    raw_P = np.floor((t * (1 + 1e-12) - fixed_P) / unit_P)
    return np.clip(raw_P, lo, hi_P).astype(np.int64)


def _remove_surplus(counts_P: np.ndarray, surplus: int, unit_P: np.ndarray,
                    fixed_P: np.ndarray, lo: int) -> np.ndarray:
    counts_P = counts_P.copy()
    while surplus > 0:
        # Take one unit from each of the `surplus` slowest parts still above `lo`.
        time_P = np.where(counts_P > lo, counts_P * unit_P + fixed_P, -np.inf)
        order = np.argsort(-time_P, kind="stable")[:surplus]
        order = order[time_P[order] > -np.inf]
        if order.size == 0:
            raise PlanError("internal: surplus units but no part above its lower bound")
        counts_P[order] -= 1
        surplus -= order.size
    return counts_P
