"""Our search: from a health map to simulated candidate plans over every useful mesh.

1. Rank every (shape, layout) with the proxy: healthy stage costs slowed by each TP group's
   speed, best layer and micro-batch split. Shapes whose even split cannot fit are skipped.
2. Screen the proxy's favourites with one simulation each of their best split in memory.
3. Fully treat the best screened layouts, plus every layout of the current shape (the cheap
   same-mesh moves): exact stage costs from simulator probes, every good split under the
   memory caps simulated, micro-batches refined from the simulated group times.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from resihp_jax.plan import Plan
from resihp_jax.perfmodel import Health
from resihp_jax.scheduler import candidates, memory_caps, stagecost
from resihp_jax.scheduler.candidates import (Layout, Split, build_plan, layer_options, layouts,
                                             rank_splits)
from resihp_jax.scheduler.context import PlanningContext
from resihp_jax.scheduler.memory_caps import MemoryLimits, fits, layer_cap, microbatch_cap
from resihp_jax.scheduler.placement import DevicePool
from resihp_jax.scheduler.scoring import refine_microbatches, simulate
from resihp_jax.scheduler.shapes import Shape, ShapeSpace, mesh_shapes
from resihp_jax.scheduler.stagecost import (StageCosts, healthy_unit_costs, probe_stage_costs,
                                            scaled_costs)

SPLITS_SIMULATED = 2  # best proxy splits simulated per layout (all of them on the current mesh)
SCREEN_FACTOR = 4  # layouts screened by one simulation, per layout fully simulated


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    step_time_s: float
    label: str


def device_pool(current: Plan, health: Health, ctx: PlanningContext) -> DevicePool:
    usable = [d for d in ctx.pool if health.alive(d)]
    return DevicePool(usable, lambda d: 1.0 - min(health.speed(d), health.link_speed(d)), current)


def memory_limits(current: Plan, ctx: PlanningContext) -> MemoryLimits:
    return MemoryLimits(ctx.model, ctx.device_memory_bytes, current.microbatch_size,
                        current.seq_len, ctx.schedule, ctx.remat)


def search_plans(current: Plan, health: Health, ctx: PlanningContext) -> list[Candidate]:
    """Simulated candidates over the alive devices, fastest first (may be empty)."""
    pool = device_pool(current, health, ctx)
    limits = memory_limits(current, ctx)
    n_screen = SCREEN_FACTOR * ctx.simulate_top
    ranked = rank_layouts(current, health, ctx, pool, limits, n_screen)
    screened = screen(ranked[:n_screen], current, health, ctx, limits)
    chosen = screened[:ctx.simulate_top]
    chosen += [(r.layout, None) for r in ranked
               if r.layout.shape == (current.dp, current.pp, current.tp)
               and not any(r.layout is layout for layout, _ in chosen)]
    out = [c for layout, costs in chosen
           for c in simulate_layout(layout, current, health, ctx, limits, costs)]
    return sorted(out, key=lambda c: c.step_time_s)


@dataclass(frozen=True)
class Ranked:
    proxy_s: float
    layout: Layout
    costs: StageCosts  # healthy costs slowed by the layout's compute speeds


def rank_layouts(current: Plan, health: Health, ctx: PlanningContext, pool: DevicePool,
                 limits: MemoryLimits, keep: int) -> list[Ranked]:
    """Layouts by proxy step time: at least the best `keep`, and all of the current shape.
    Branch and bound: shapes in order of a lower bound on their proxy time (perfect balance,
    every device at full speed), none past the `keep`-th best time found once its bound is,
    so hopeless shapes (deep pipelines over a few groups, many idle devices) cost nothing."""
    n_mb, n_layers = current.n_microbatches, ctx.model.n_layers
    space = ShapeSpace(pool.n_usable, pool.n_slow, n_layers, n_mb, min_dp=ctx.min_dp)
    shapes = sorted((_proxy_lower_bound(shape, current, ctx), shape)
                    for shape in mesh_shapes(ctx.model, space))
    out: list[Ranked] = []
    kth_best = math.inf
    for bound, shape in shapes:
        if bound > kth_best and shape != (current.dp, current.pp, current.tp):
            continue
        out += _rank_shape(shape, current, health, ctx, pool, limits)
        if len(out) >= keep:
            kth_best = sorted(r.proxy_s for r in out)[keep - 1]
    return sorted(out, key=lambda r: r.proxy_s)


def _proxy_lower_bound(shape: Shape, current: Plan, ctx: PlanningContext) -> float:
    dp, pp, tp = shape
    costs = healthy_unit_costs(ctx.model, ctx.costs, pp, tp, current.microbatch_size,
                               current.seq_len, ctx.remat)
    per_stage = (ctx.model.n_layers * costs.unit_GxS[0, 0] + costs.fixed_GxS.sum()) / pp
    ticks = current.n_microbatches / dp + pp - 1
    return ticks * (per_stage + 2 * ctx.costs.tick_overhead)


def _rank_shape(shape: Shape, current: Plan, health: Health, ctx: PlanningContext,
                pool: DevicePool, limits: MemoryLimits) -> list[Ranked]:
    """The proxy's verdict on each layout of one shape (none if its even split cannot fit)."""
    (dp, pp, tp), n_layers, n_mb = shape, ctx.model.n_layers, current.n_microbatches
    if not fits(limits, pp, tp, math.ceil(n_layers / pp), math.ceil(n_mb / dp)):
        return []
    healthy = healthy_unit_costs(ctx.model, ctx.costs, pp, tp, current.microbatch_size,
                                 current.seq_len, ctx.remat)
    out = []
    for layout in layouts(shape, pool, current):
        costs = scaled_costs(healthy, health.speeds_of(layout.grid_DxPxT).min(axis=2))
        splits = rank_splits(costs, layer_options(costs, n_layers, None, None), n_mb,
                             ctx.costs.tick_overhead)
        if splits:
            out.append(Ranked(splits[0].proxy_s, layout, costs))
    return out


def screen(ranked: list[Ranked], current: Plan, health: Health, ctx: PlanningContext,
           limits: MemoryLimits) -> list[tuple[Layout, StageCosts]]:
    """Re-rank the proxy's favourites by one simulation each of their best capped split under
    exact stage costs; the simulator sees what the proxy ignores (slow links, transfers,
    all-reduce, the real schedule). Returns layouts with those costs, best first."""
    out = []
    for r in ranked:
        costs = _exact_costs(r.layout, current, health, ctx)
        splits, _ = capped_splits(r.layout, costs, current, ctx, limits)
        if splits:
            plan = build_plan(r.layout, splits[0], current)
            out.append((simulate(plan, health, ctx).step_time_s, r.layout, costs))
    out.sort(key=lambda item: item[0])
    return [(layout, costs) for _, layout, costs in out]


def _exact_costs(layout: Layout, current: Plan, health: Health,
                 ctx: PlanningContext) -> StageCosts:
    return probe_stage_costs(layout.grid_DxPxT, ctx.model, ctx.costs,
                             microbatch_size=current.microbatch_size, seq_len=current.seq_len,
                             remat=ctx.remat, health=health)


def capped_splits(layout: Layout, costs: StageCosts, current: Plan, ctx: PlanningContext,
                  limits: MemoryLimits) -> tuple[list[Split], Callable[[int], int]]:
    """The layout's layer splits with their micro-batch splits, all within memory, best
    first; and the micro-batch cap as a function of the largest stage's layers."""
    dp, pp, tp = layout.shape
    n_mb = current.n_microbatches

    def mb_cap_of(layer_slots: int) -> int:
        return microbatch_cap(limits, dp, pp, tp, layer_slots, n_mb)

    cap = layer_cap(limits, dp, pp, tp, math.ceil(n_mb / dp))
    if cap * pp < ctx.model.n_layers:
        return [], mb_cap_of
    options = layer_options(costs, ctx.model.n_layers, cap,
                            current.layers_per_stage if pp == current.pp else None)
    return rank_splits(costs, options, n_mb, ctx.costs.tick_overhead, mb_cap_of), mb_cap_of


def simulate_layout(layout: Layout, current: Plan, health: Health, ctx: PlanningContext,
                    limits: MemoryLimits, costs: StageCosts | None = None) -> list[Candidate]:
    """Simulated plans of one layout: exact stage costs, best splits in memory, refined."""
    dp, pp, tp = layout.shape
    costs = _exact_costs(layout, current, health, ctx) if costs is None else costs
    splits, mb_cap_of = capped_splits(layout, costs, current, ctx, limits)
    on_current_mesh = layout.shape == (current.dp, current.pp, current.tp)
    out = []
    for split in splits if on_current_mesh else splits[:SPLITS_SIMULATED]:
        plan = build_plan(layout, split, current)
        plan, step_s = refine_microbatches(plan, health, ctx, mb_cap_of(max(split.layers_S)))
        label = (f"dp={dp},pp={pp},tp={tp} (placement: {layout.placement}; {split.name} "
                 "layers)")
        out.append(Candidate(plan, step_s, label))
    return out


def clear_caches() -> None:
    """Forget memoized stage costs and memory answers (to time planning from cold)."""
    candidates.clear_cache()
    memory_caps.clear_cache()
    stagecost.clear_cache()
