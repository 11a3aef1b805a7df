"""Closed-form step times of a degraded data-parallel job of pipelines, in the simulator's terms.

A DP group of pp stages with m micro-batches takes tick * (m + pp - 1) * s, where tick is the
healthy per-micro-batch stage time of its mesh shape (from the pipeline simulator) and s >= 1
the group's slowdown. Groups then join one all-reduce (the shape's fixed time). With
micro-batches rebalanced by speed (ours, Greyhound, Malleus, Oobleck's batch distribution)
every group finishes together: T = tick * (B + sum_g (pp_g - 1)) / sum_g (1 / s_g) (relaxed
to real numbers, never below the healthy integer split); without rebalancing the slowest
group sets the pace. A slow device nobody has detected gates the step by its slowdown: the
plan gave its group a healthy share.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from resihp_jax.sim.cluster import ShapeCost


@functools.lru_cache(maxsize=4096)
def layer_rebalanced(factor: float, pp: int, n_layers: int) -> float:
    """Slowdown of a pipeline with one stage `factor` times slower once layers are moved off
    that stage (integer layers, at least one per stage); `factor` with pp == 1."""
    if pp == 1 or factor <= 1.0:
        return max(factor, 1.0)
    slow_L = np.arange(1, n_layers - pp + 2, dtype=np.float64)
    others_L = np.ceil((n_layers - slow_L) / (pp - 1))
    worst = float(np.min(np.maximum(factor * slow_L, others_L)))
    healthy = float(np.min(np.maximum(slow_L, others_L)))
    return max(worst / healthy, 1.0)


def rebalanced_step_s(cost: ShapeCost, n_mb: int, dp: int, slow_K: np.ndarray,
                      gate: float = 1.0) -> float:
    """Step time of `dp` groups, `slow_K` of them slowed (one slowdown each), micro-batches
    split by speed."""
    healthy_T = cost.tick_s * (math.ceil(n_mb / dp) + cost.pp - 1)
    k = min(len(slow_K), dp)
    if k == 0:
        return healthy_T * gate + cost.fixed_s
    inv = (dp - k) + float(np.sum(1.0 / np.asarray(slow_K[:k], dtype=np.float64)))
    T = cost.tick_s * (n_mb + dp * (cost.pp - 1)) / inv
    return max(T, healthy_T) * gate + cost.fixed_s


def uniform_step_s(cost: ShapeCost, n_mb: int, dp: int, worst: float) -> float:
    """Step time with micro-batches split evenly: the slowest group sets the pace."""
    return cost.tick_s * (math.ceil(n_mb / dp) + cost.pp - 1) * max(worst, 1.0) + cost.fixed_s


def pipelines_step_s(costs: list[tuple[ShapeCost, int]], n_mb: int, fixed_s: float,
                     gate: float = 1.0) -> float:
    """Heterogeneous pipelines (shape, how many), micro-batches split by speed (Oobleck)."""
    inv = sum(count / cost.tick_s for cost, count in costs)
    bubbles = sum(count * (cost.pp - 1) for cost, count in costs)
    if inv <= 0:
        return math.inf
    return (n_mb + bubbles) / inv * gate + fixed_s


def usable_groups(unusable: set[int] | frozenset[int], tp: int, n_gpus: int,
                  node_size: int) -> int:
    """TP groups of degree `tp` that fit inside hosts, leaving out the unusable GPUs."""
    per_node = node_size // tp
    total = (n_gpus // node_size) * per_node
    hit: dict[int, int] = {}
    for d in unusable:
        hit[d // node_size] = hit.get(d // node_size, 0) + 1
    return total - sum(per_node - (node_size - c) // tp for c in hit.values())
