"""Score plans with the pipeline simulator, and refine a micro-batch split from its output."""

from __future__ import annotations

import numpy as np

from resihp_jax.errors import PlanError
from resihp_jax.plan import Plan
from resihp_jax.perfmodel import Health, StepSim, simulate_step
from resihp_jax.scheduler.context import PlanningContext
from resihp_jax.scheduler.stagecost import split_microbatches


def simulate(plan: Plan, health: Health | None, ctx: PlanningContext) -> StepSim:
    return simulate_step(plan, ctx.model, ctx.costs, health=health, schedule=ctx.schedule,
                         remat=ctx.remat, trace=False)


def step_time_s(plan: Plan, health: Health | None, ctx: PlanningContext) -> float:
    """Simulated step time; inf when the plan uses a dead device."""
    if health is not None and health.dead & set(plan.device_ids):
        return float("inf")
    return simulate(plan, health, ctx).step_time_s


def refine_microbatches(plan: Plan, health: Health | None, ctx: PlanningContext,
                        mb_cap: int | None = None, rounds: int = 2) -> tuple[Plan, float]:
    """Re-split micro-batches by each group's simulated time per tick until it stops helping:
    the proxy's ticks leave out the transfers and lock-step waits the simulator counts."""
    sim = simulate(plan, health, ctx)
    best, best_s = plan, sim.step_time_s
    for _ in range(rounds):
        counts_G = np.asarray(best.microbatches_per_group, dtype=np.float64)
        tick_G = np.asarray(sim.group_times_s, dtype=np.float64) / (counts_G + best.pp - 1)
        try:
            new_G = split_microbatches(best.n_microbatches, tick_G, best.pp, mb_cap)
        except PlanError:
            break
        new_counts = tuple(int(c) for c in new_G)
        if new_counts == best.microbatches_per_group:
            break
        trial = best.replace(microbatches_per_group=new_counts)
        sim = simulate(trial, health, ctx)
        if sim.step_time_s >= best_s:
            break
        best, best_s = trial, sim.step_time_s
    return best, best_s
