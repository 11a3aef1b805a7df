"""Closed-form step times of a degraded data-parallel job of pipelines, in the simulator's terms.

A DP group of pp stages with m micro-batches takes tick * (m + pp - 1) * s (tick: the shape's
healthy per-micro-batch stage time; s >= 1 the group's slowdown), then one all-reduce (the
shape's fixed time). Rebalanced by speed, micro-batches stay whole: the step is the least T
with sum_g floor(T / (tick_g * s_g) - (pp_g - 1)) >= B (so a lost replica out of many with 8
micro-batches each can cost a whole extra tick); without rebalancing the slowest group sets
the pace. An undetected slow device gates the step by its slowdown.
"""

from __future__ import annotations

import functools
import math
from collections import Counter

import numpy as np

from resihp_jax.sim.cluster import ShapeCost


@functools.lru_cache(maxsize=4096)
def layer_rebalanced(factor: float, pp: int, n_layers: int, cap: int | None = None) -> float:
    """Slowdown of a pipeline with one stage `factor` times slower once layers are moved off
    that stage (integer layers, at least one per stage, at most `cap` per stage as memory
    allows); `factor` with pp == 1."""
    if pp == 1 or factor <= 1.0:
        return max(factor, 1.0)
    cap = n_layers if cap is None else cap
    slow_L = np.arange(1, n_layers - pp + 2, dtype=np.float64)
    others_L = np.ceil((n_layers - slow_L) / (pp - 1))
    ok_L = (others_L <= cap) & (slow_L <= cap)
    if not ok_L.any():
        return factor
    worst = float(np.min(np.maximum(factor * slow_L, others_L)[ok_L]))
    healthy = float(np.min(np.maximum(slow_L, others_L)[ok_L]))
    return min(max(worst / healthy, 1.0), factor)


def makespan_ticks(ticks_G: np.ndarray, pp_G: np.ndarray, count_G: np.ndarray,
                   n_mb: int) -> float:
    """Least time (in ticks of 1.0) at which groups of per-micro-batch time ticks_G, depth
    pp_G, `count_G` of each, hold all n_mb whole micro-batches (inf if they cannot)."""
    ok = np.isfinite(ticks_G) & (count_G > 0)
    ticks_G, pp_G, count_G = ticks_G[ok], pp_G[ok], count_G[ok]
    if not ticks_G.size:
        return math.inf

    def holds(t: float) -> bool:
        return float(np.sum(count_G * np.maximum(np.floor(t / ticks_G - (pp_G - 1)), 0))) >= n_mb

    lo, hi = 0.0, float(np.max(ticks_G * (math.ceil(n_mb / count_G.sum()) + pp_G - 1)))
    while not holds(hi):
        hi *= 2.0
    for _ in range(60):  # bisection to a breakpoint (t = tick * (m + pp - 1)) within 1e-15
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if holds(mid) else (mid, hi)
    return hi


def rebalanced_step_s(cost: ShapeCost, n_mb: int, dp: int, slow_K: np.ndarray,
                      gate: float = 1.0) -> float:
    """Step time of `dp` groups, `slow_K` of them slowed (one slowdown each), whole
    micro-batches split by speed."""
    k = min(len(slow_K), dp)
    if k == 0:
        return cost.tick_s * (math.ceil(n_mb / dp) + cost.pp - 1) * gate + cost.fixed_s
    ticks_G = np.concatenate([[1.0], np.asarray(slow_K[:k], dtype=np.float64)])
    count_G = np.concatenate([[dp - k], np.ones(k)])
    ticks = makespan_ticks(ticks_G, np.full(k + 1, cost.pp), count_G, n_mb)
    return cost.tick_s * ticks * gate + cost.fixed_s


def uniform_step_s(cost: ShapeCost, n_mb: int, dp: int, worst: float) -> float:
    """Step time with micro-batches split evenly: the slowest group sets the pace."""
    return cost.tick_s * (math.ceil(n_mb / dp) + cost.pp - 1) * max(worst, 1.0) + cost.fixed_s


def pipelines_step_s(costs: list[tuple[ShapeCost, int]], n_mb: int, fixed_s: float,
                     gate: float = 1.0) -> float:
    """Heterogeneous pipelines (shape, how many), whole micro-batches split by speed
    (Oobleck)."""
    ticks_G = np.asarray([c.tick_s for c, _ in costs])
    pp_G = np.asarray([c.pp for c, _ in costs], dtype=np.float64)
    count_G = np.asarray([n for _, n in costs], dtype=np.float64)
    return makespan_ticks(ticks_G, pp_G, count_G, n_mb) * gate + fixed_s


def usable_groups(unusable: set[int] | frozenset[int], tp: int, n_gpus: int,
                  node_size: int) -> int:
    """TP groups of degree `tp` that fit inside hosts, leaving out the unusable GPUs."""
    per_node = node_size // tp
    total = (n_gpus // node_size) * per_node
    hit = Counter(d // node_size for d in unusable)
    return total - sum(per_node - (node_size - c) // tp for c in hit.values())
