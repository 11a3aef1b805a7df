"""Exhaustive plan search for small clusters: the reference the fast search is checked against.

Simulates every mesh shape, placement of the slow devices (each anywhere, or left out), layer
split and micro-batch split that fits memory. Exact yet small by two symmetries: healthy
devices are interchangeable, and DP groups of equal speeds share micro-batches evenly
(`_class_balanced_counts`). Only for a few devices, layers and micro-batches.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np

from resihp_jax.errors import PlanError
from resihp_jax.plan import Plan
from resihp_jax.perfmodel import Health
from resihp_jax.scheduler.context import PlanningContext
from resihp_jax.scheduler.memory_caps import MemoryLimits, fits
from resihp_jax.scheduler.scoring import simulate
from resihp_jax.scheduler.search import Candidate, memory_limits
from resihp_jax.scheduler.shapes import tp_degrees


def exhaustive_best(current: Plan, health: Health, ctx: PlanningContext,
                    max_plans: int = 200_000) -> Candidate | None:
    """The fastest plan of the whole plan space (None if nothing fits); PlanError past
    `max_plans` simulations, so it is never run by accident on a big cluster."""
    best: Candidate | None = None
    for n_simulated, plan in enumerate(_plans(current, health, ctx), start=1):
        if n_simulated > max_plans:
            raise PlanError(f"exhaustive search exceeded max_plans={max_plans}; it is meant "
                            "for a few devices, layers and micro-batches")
        step_s = simulate(plan, health, ctx).step_time_s
        if best is None or step_s < best.step_time_s:
            best = Candidate(plan, step_s, f"exhaustive: {plan.describe()}")
    return best


def _plans(current: Plan, health: Health, ctx: PlanningContext) -> Iterator[Plan]:
    alive = [d for d in ctx.pool if health.alive(d)]
    faulty = [d for d in alive if min(health.speed(d), health.link_speed(d)) < 1.0]
    healthy = [d for d in alive if d not in faulty]
    limits = memory_limits(current, ctx)
    n_layers, n_mb = ctx.model.n_layers, current.n_microbatches
    for tp in tp_degrees(ctx.model):
        for pp in range(1, min(n_layers, len(alive) // tp) + 1):
            for dp in range(1, min(n_mb, len(alive) // (pp * tp)) + 1):
                for grid in _grids(dp, pp, tp, healthy, faulty, health):
                    yield from _splits(grid, current, limits, n_layers, n_mb, health)


def _grids(dp: int, pp: int, tp: int, healthy: list[int], faulty: list[int],
           health: Health) -> Iterator[np.ndarray]:
    """One grid per distinct pattern of device speeds and links, up to DP-group order."""
    n_slots, seen = dp * pp * tp, set()
    for k in range(min(len(faulty), n_slots) + 1):
        if n_slots - k > len(healthy):
            continue
        for chosen in itertools.combinations(faulty, k):
            for slots in itertools.permutations(range(n_slots), k):
                flat = np.full(n_slots, -1, dtype=np.int64)
                flat[list(slots)] = chosen
                flat[flat < 0] = healthy[:n_slots - k]
                grid = flat.reshape(dp, pp, tp)
                key = _canonical_key(grid, health)
                if key not in seen:
                    seen.add(key)
                    yield grid


def _canonical_key(grid: np.ndarray, health: Health) -> tuple:
    rows = np.concatenate([health.speeds_of(grid), health.link_speeds_of(grid)], axis=2)
    return tuple(sorted(tuple(r.ravel().tolist()) for r in rows))


def _splits(grid: np.ndarray, current: Plan, limits: MemoryLimits, n_layers: int, n_mb: int,
            health: Health) -> Iterator[Plan]:
    dp, pp, tp = grid.shape
    ids = tuple(grid.ravel().tolist())
    class_G = _speed_classes(grid, health)
    for layers in _compositions(n_layers, pp):
        if not fits(limits, pp, tp, max(layers), math.ceil(n_mb / dp)):
            continue
        for counts in _class_balanced_counts(n_mb, class_G):
            if fits(limits, pp, tp, max(layers), max(counts)):
                yield Plan(dp, pp, tp, ids, layers, counts, current.microbatch_size,
                           current.seq_len)


def _speed_classes(grid: np.ndarray, health: Health) -> np.ndarray:
    """[dp] class index of each DP group; groups of a class have the same speeds and links."""
    rows = np.concatenate([health.speeds_of(grid), health.link_speeds_of(grid)], axis=2)
    _, class_G = np.unique(rows.reshape(rows.shape[0], -1), axis=0, return_inverse=True)
    return class_G.reshape(-1)


def _class_balanced_counts(n_mb: int, class_G: np.ndarray) -> Iterator[tuple[int, ...]]:
    """Every split of the micro-batches over the classes, even within each class.

    A group's simulated time only grows with its own count and with the largest count (the
    padded slots), so within a class of equal groups an even split is never worse than an
    uneven one with the same total: it lowers the class's largest count and nothing else.
    """
    sizes = np.bincount(class_G)
    for totals in _compositions(n_mb - int(sizes.sum()), sizes.shape[0], lo=0):
        counts_G = np.empty(class_G.shape[0], dtype=np.int64)
        for c, size in enumerate(sizes.tolist()):
            members = np.flatnonzero(class_G == c)
            q, r = divmod(totals[c] + size, size)
            counts_G[members] = q + (np.arange(size) < r)
        yield tuple(counts_G.tolist())


def _compositions(total: int, parts: int, lo: int = 1) -> Iterator[tuple[int, ...]]:
    """Every way to write `total` as `parts` integers >= `lo`, in order."""
    spare = total - lo * parts
    if spare < 0:
        return
    for cuts in itertools.combinations(range(spare + parts - 1), parts - 1):
        bounds = (-1,) + cuts + (spare + parts - 1,)
        yield tuple(bounds[i + 1] - bounds[i] - 1 + lo for i in range(parts))
