"""Policies by name (ours and the baselines), and their outcomes measured the same way.

Every outcome is the proposed plan's simulated throughput on the degraded devices, as a
fraction of the current plan's healthy throughput and of the capacity bound (the alive
devices' summed speed over the pool size, times healthy throughput).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan
from resihp_jax.perfmodel import Health
from resihp_jax.scheduler import baselines
from resihp_jax.scheduler.context import PlanningContext, Policy
from resihp_jax.scheduler.resihp import resihp
from resihp_jax.scheduler.scoring import step_time_s

OURS = "resihp"
POLICIES: dict[str, Policy] = {
    OURS: resihp,
    "none": baselines.no_adaptation,
    "replica_drop": baselines.replica_drop,
    "oobleck": baselines.oobleck,
    "greyhound": baselines.greyhound,
    "malleus": baselines.malleus,
}
BASELINES = tuple(name for name in POLICIES if name != OURS)


def get_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ConfigError(f"unknown scheduler policy {name!r}; valid: {', '.join(POLICIES)}")
    return POLICIES[name]


@dataclass(frozen=True)
class Reference:
    """Healthy throughput of the current plan and the capacity left by a health map."""

    healthy_tokens_per_s: float
    capacity_fraction: float  # sum of alive speeds over the pool / pool size


def reference(current: Plan, health: Health, ctx: PlanningContext) -> Reference:
    healthy = current.tokens_per_step / step_time_s(current, None, ctx)
    return Reference(healthy, health.capacity(ctx.pool) / len(ctx.pool))


@dataclass(frozen=True)
class Outcome:
    policy: str
    plan: Plan | None
    step_time_s: float  # inf when the job cannot run
    tokens_per_s: float
    fraction_of_healthy: float
    fraction_of_capacity_bound: float
    switch_s: float
    reason: str
    planning_time_s: float
    preserves_global_batch: bool
    interim: Plan | None = None  # trained while `plan` compiles in the background

    def summary(self) -> dict[str, Any]:
        """The keys the `resihp plan --json` output promises for every policy."""
        return {"plan": None if self.plan is None else self.plan.to_dict(),
                "fraction_of_healthy": self.fraction_of_healthy,
                "fraction_of_capacity_bound": self.fraction_of_capacity_bound}


def run_policy(name: str, current: Plan, health: Health, ctx: PlanningContext,
               ref: Reference | None = None,
               clock: Callable[[], float] = time.perf_counter) -> Outcome:
    """Run one policy and measure its plan on `health`."""
    policy = get_policy(name)
    ref = reference(current, health, ctx) if ref is None else ref
    start = clock()
    proposal = policy(current, health, ctx)
    elapsed = clock() - start
    plan = proposal.plan
    step_s = math.inf if plan is None else step_time_s(plan, health, ctx)
    rate = 0.0 if plan is None else plan.tokens_per_step / step_s
    bound = ref.capacity_fraction * ref.healthy_tokens_per_s
    return Outcome(name, plan, step_s, rate, rate / ref.healthy_tokens_per_s,
                   rate / bound if bound > 0 else 0.0, proposal.switch_s, proposal.reason,
                   elapsed, proposal.preserves_global_batch, proposal.interim)


def compare(current: Plan, health: Health, ctx: PlanningContext,
            names: tuple[str, ...] = tuple(POLICIES)) -> dict[str, Outcome]:
    """Outcomes of several policies against one shared reference."""
    ref = reference(current, health, ctx)
    return {name: run_policy(name, current, health, ctx, ref) for name in names}
