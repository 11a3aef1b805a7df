"""Other systems' policies, re-expressed as Plans under the same interface as ours.

Each gets its best reasonable reading (the simulator makes the choices it leaves open in its
favour), so ours is not compared against a straw man:
- none: the current plan on the degraded devices; a dead device stops the job (0 throughput).
- replica_drop (FT-HSDP / torchft): drop every DP replica holding a dead device, and one
  holding a slow device when faster; survivors keep their micro-batches (the global batch
  shrinks, as in torchft; throughput counts only the rows trained).
- oobleck: uniform re-mesh of the current tp over the healthy (or, if faster, all alive)
  devices, best pipeline depth, even layer and micro-batch splits.
- greyhound: micro-batch rebalancing only, by each DP group's simulated time; a group with a
  dead device is left out (the global batch is kept).
- malleus: the current (pp, tp) over the least slow devices, stragglers grouped, layer and
  data splits by speed from its own analytic cost model (an exact min-max solver for its
  integer programs); no simulation, no search over mesh shapes.
"""

from __future__ import annotations

import numpy as np

from resihp_jax.plan import Plan
from resihp_jax.perfmodel import Health, fits_memory
from resihp_jax.scheduler.candidates import Layout, build_plan, layer_options, rank_splits
from resihp_jax.scheduler.context import PlanningContext, Proposal, faulty_in, keeps_current
from resihp_jax.scheduler.memory_caps import layer_cap, microbatch_cap
from resihp_jax.scheduler.placement import base_grid, place
from resihp_jax.scheduler.scoring import refine_microbatches, step_time_s
from resihp_jax.scheduler.search import device_pool, memory_limits
from resihp_jax.scheduler.stagecost import healthy_unit_costs, scaled_costs


def no_adaptation(current: Plan, health: Health, ctx: PlanningContext) -> Proposal:
    if health.dead & set(current.device_ids):
        return Proposal(None, "a device of the plan is dead: the job stops")
    return Proposal(current, "no adaptation: the current plan on the degraded devices")


def _groups(plan: Plan, keep_G: np.ndarray, counts: tuple[int, ...] | None = None) -> Plan:
    """The plan restricted to the DP groups in `keep_G` (their own micro-batches by default)."""
    grid = plan.device_grid()[keep_G]
    mbs = tuple(np.asarray(plan.microbatches_per_group)[keep_G]) if counts is None else counts
    return plan.replace(dp=int(keep_G.sum()), device_ids=tuple(grid.ravel().tolist()),
                        microbatches_per_group=mbs)


def _group_flags(plan: Plan, health: Health) -> tuple[np.ndarray, np.ndarray]:
    """[dp] groups holding a dead device, [dp] groups holding a slow one."""
    grid = plan.device_grid()
    dead_G = np.asarray([not all(health.alive(d) for d in g.ravel()) for g in grid])
    slow_G = np.asarray([faulty_in(g.ravel().tolist(), health) for g in grid]) & ~dead_G
    return dead_G, slow_G


@keeps_current
def replica_drop(current: Plan, health: Health, ctx: PlanningContext) -> Proposal:
    dead_G, slow_G = _group_flags(current, health)
    options = []
    for drop_G in {tuple(dead_G), tuple(dead_G | slow_G)}:
        keep_G = ~np.asarray(drop_G)
        if keep_G.any():
            plan = _groups(current, keep_G)
            options.append((plan.tokens_per_step / step_time_s(plan, health, ctx), plan))
    if not options:
        return Proposal(None, "every DP replica holds a failed device", 0.0, False)
    _, plan = max(options, key=lambda o: o[0])
    if plan.dp == current.dp:
        return Proposal(plan, "kept every replica: dropping the slow one would be slower", 0.0,
                        False)
    return Proposal(plan, f"dropped {current.dp - plan.dp} DP replica(s); the others continue "
                    "with their own micro-batches (smaller global batch)", 0.0, False)


@keeps_current
def greyhound(current: Plan, health: Health, ctx: PlanningContext) -> Proposal:
    dead_G, _ = _group_flags(current, health)
    n_keep = int((~dead_G).sum())
    if n_keep == 0:
        return Proposal(None, "every DP group holds a dead device")
    share = np.full(n_keep, current.n_microbatches // n_keep)
    share[:current.n_microbatches % n_keep] += 1
    start = _groups(current, ~dead_G, tuple(int(c) for c in share))
    limits = memory_limits(current, ctx)
    cap = microbatch_cap(limits, start.dp, start.pp, start.tp, max(start.layers_per_stage),
                         start.n_microbatches)
    plan, _ = refine_microbatches(start, health, ctx, cap, rounds=4)
    return Proposal(plan, "rebalanced micro-batches by each DP group's simulated speed")


@keeps_current
def oobleck(current: Plan, health: Health, ctx: PlanningContext) -> Proposal:
    alive = [d for d in ctx.pool if health.alive(d)]
    healthy = [d for d in alive if not faulty_in([d], health)]
    best: tuple[float, Plan] | None = None
    for usable in {tuple(healthy), tuple(alive)}:
        for plan in _uniform_meshes(current, usable, ctx):
            rate = plan.tokens_per_step / step_time_s(plan, health, ctx)
            if best is None or rate > best[0]:
                best = (rate, plan)
    if best is None:
        return Proposal(None, "no uniform mesh of the current tp fits the usable devices")
    return Proposal(best[1], "uniform re-mesh with even splits")


def _uniform_meshes(current: Plan, usable: tuple[int, ...], ctx: PlanningContext) -> list[Plan]:
    rank = {d: i for i, d in enumerate(current.device_ids)}
    ordered = sorted(usable, key=lambda d: rank.get(d, len(rank) + d))
    out, tp = [], current.tp
    for pp in range(1, ctx.model.n_layers + 1):
        dp = min(len(ordered) // (pp * tp), current.n_microbatches)
        if dp < 1:
            continue
        plan = Plan.uniform(dp, pp, tp, n_layers=ctx.model.n_layers,
                            n_microbatches=current.n_microbatches,
                            microbatch_size=current.microbatch_size, seq_len=current.seq_len,
                            device_ids=ordered[:dp * pp * tp])
        if fits_memory(plan, ctx.model, ctx.device_memory_bytes, schedule=ctx.schedule,
                       remat=ctx.remat):
            out.append(plan)
    return out


@keeps_current
def malleus(current: Plan, health: Health, ctx: PlanningContext) -> Proposal:
    pool, limits = device_pool(current, health, ctx), memory_limits(current, ctx)
    pp, tp, n_mb = current.pp, current.tp, current.n_microbatches
    dp_max = min(pool.n_usable // (pp * tp), n_mb)
    healthy = healthy_unit_costs(ctx.model, ctx.costs, pp, tp, current.microbatch_size,
                                 current.seq_len, ctx.remat)
    best = None
    for dp in range(dp_max, max(dp_max - 2, 0), -1):  # keep or leave out the slowest
        grid = place(base_grid(pool.choose(dp * pp * tp), dp, pp, tp, current), "pack_dp",
                     pool.slowest_first)
        costs = scaled_costs(healthy, health.speeds_of(grid).min(axis=2))
        cap = layer_cap(limits, dp, pp, tp, -(-n_mb // dp))
        if cap * pp < ctx.model.n_layers:
            continue
        splits = rank_splits(costs, layer_options(costs, ctx.model.n_layers, cap, None), n_mb,
                             ctx.costs.tick_overhead,
                             lambda n, dp=dp: microbatch_cap(limits, dp, pp, tp, n, n_mb))
        if splits and (best is None or splits[0].proxy_s < best[0]):
            best = (splits[0].proxy_s, build_plan(Layout(grid, "pack_dp"), splits[0], current))
    if best is None:
        return Proposal(None, f"no plan with pp={pp}, tp={tp} fits the usable devices")
    return Proposal(best[1], "speed-aware non-uniform layer and data split (Malleus-style)")
