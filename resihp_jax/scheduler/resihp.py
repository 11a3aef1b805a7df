"""ResiHP's policy: search every useful plan, then switch only when the switch pays."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

from resihp_jax.errors import PlanError
from resihp_jax.plan import Plan
from resihp_jax.perfmodel import Health, memory_bytes_per_device
from resihp_jax.scheduler.context import PlanningContext, Proposal, keeps_current
from resihp_jax.scheduler.memory_caps import MemoryLimits, fits
from resihp_jax.scheduler.scoring import step_time_s
from resihp_jax.scheduler.search import memory_limits, search_plans
from resihp_jax.scheduler.shapes import ShapeSpace, mesh_shapes
from resihp_jax.scheduler.switching import (Option, choose, switch_seconds,
                                            with_background_compiles)


@keeps_current
def resihp(current: Plan, health: Health, ctx: PlanningContext) -> Proposal:
    """Our next plan for `health`: the option training the most steps before the next failure."""
    n_alive = sum(1 for d in ctx.pool if health.alive(d))
    if n_alive == 0:
        raise PlanError(f"no alive devices: all {len(ctx.pool)} devices of the pool are dead")
    candidates = search_plans(current, health, ctx)
    runnable = not (health.dead & set(current.device_ids))
    stay = Option(current, step_time_s(current, health, ctx), 0.0, "current plan") \
        if runnable else None
    options = [Option(c.plan, c.step_time_s, switch_seconds(current, c.plan, ctx.model,
                                                             ctx.switch), c.label)
               for c in candidates]
    if stay is None and not options:
        raise PlanError(explain_no_plan(current, n_alive, ctx))
    horizon_s = ctx.switch.expected_horizon_s(n_alive)
    if ctx.switch.background and stay is not None:  # a dead device must be left at once
        options = with_background_compiles(current, stay, options, ctx.switch, horizon_s)
    best, reason = choose(stay, options, horizon_s)
    return Proposal(best.plan, reason, best.switch_s, interim=best.interim)


def explain_no_plan(current: Plan, n_alive: int, ctx: PlanningContext) -> str:
    """Why no plan exists: too few alive devices for memory, or nothing fits at all."""
    gb = ctx.device_memory_bytes / 1e9
    need = _fewest_devices_that_fit(current, len(ctx.pool), ctx)
    if need is None:
        least = _least_memory(current, len(ctx.pool), ctx)
        return (f"nothing fits memory: even on all {len(ctx.pool)} devices the leanest plan "
                f"needs {least / 1e9:.1f} GB per device; devices have {gb:.1f} GB "
                "(--device-memory-gb)")
    return (f"too few alive devices: {n_alive} are alive but the model needs at least {need} "
            f"devices to fit in {gb:.1f} GB each")


def _fewest_devices_that_fit(current: Plan, n_max: int, ctx: PlanningContext) -> int | None:
    limits = memory_limits(current, ctx)
    space = ShapeSpace(n_max, 0, ctx.model.n_layers, current.n_microbatches, 0)
    best = None
    for dp_max, pp, tp in mesh_shapes(ctx.model, space):
        # Wider dp holds fewer micro-batches per group, so fitting is monotone in dp.
        dp = _smallest(lambda d: _fits_even(limits, d, pp, tp, current), dp_max)  # noqa: B023
        if dp is not None and (best is None or dp * pp * tp < best):
            best = dp * pp * tp
    return best


def _smallest(ok: Callable[[int], bool], upper: int) -> int | None:
    """Smallest n in [1, upper] with ok(n) for a monotone predicate; None if none."""
    n = bisect.bisect_left(range(1, upper + 1), True, key=ok) + 1
    return n if n <= upper else None


def _fits_even(limits: MemoryLimits, dp: int, pp: int, tp: int, current: Plan) -> bool:
    return fits(limits, pp, tp, math.ceil(limits.model.n_layers / pp),
                math.ceil(current.n_microbatches / dp))


def _least_memory(current: Plan, n_max: int, ctx: PlanningContext) -> float:
    space = ShapeSpace(n_max, 0, ctx.model.n_layers, current.n_microbatches, 0)
    least = math.inf
    for dp, pp, tp in mesh_shapes(ctx.model, space):
        plan = Plan.uniform(dp, pp, tp, n_layers=ctx.model.n_layers,
                            n_microbatches=current.n_microbatches,
                            microbatch_size=current.microbatch_size, seq_len=current.seq_len)
        need = memory_bytes_per_device(plan, ctx.model, schedule=ctx.schedule, remat=ctx.remat)
        least = min(least, float(need.max()))
    return least
