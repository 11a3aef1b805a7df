"""What every policy returns: the next plan (or none: the job cannot run) and why."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from resihp_jax.meshes.plan import Plan
from resihp_jax.perfmodel import Health
from resihp_jax.scheduler.context import PlanningContext


@dataclass(frozen=True)
class Proposal:
    plan: Plan | None  # None: this policy cannot keep the job running
    reason: str
    switch_s: float = 0.0  # predicted cost of moving to `plan` (0 when it is the current plan)
    preserves_global_batch: bool = True  # False when the policy trains fewer rows per step
    # the plan to train while `plan`'s program compiles in the background (None: switch to
    # `plan` at once); the current program runs it, so it compiles nothing
    interim: Plan | None = None


Policy = Callable[[Plan, Health, PlanningContext], Proposal]


def faulty_in(devices: Iterable[int], health: Health) -> bool:
    """True when any of `devices` is dead or slow (compute or link)."""
    return any(not health.alive(d) or health.speed(d) < 1.0 or health.link_speed(d) < 1.0
               for d in devices)


def keep_current(current: Plan, health: Health, ctx: PlanningContext) -> Proposal | None:
    """The current plan when none of its devices is faulty (faulty spares do not matter)."""
    del ctx  # same signature as the policies, so each can start with this check
    if faulty_in(current.device_ids, health):
        return None
    return Proposal(current, "no faults on the plan's devices: kept the current plan")
