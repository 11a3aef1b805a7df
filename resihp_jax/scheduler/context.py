"""A policy's interface: what it plans against (the model, its costs, memory, devices, switch
costs) and what it returns (the next plan, or none: the job cannot run, and why)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan
from resihp_jax.perfmodel import SCHEDULES, CostParams, Health
from resihp_jax.perfmodel.facts import ModelFacts


@dataclass(frozen=True)
class SwitchCosts:
    """What moving to a new plan costs, and how long the new plan is expected to last."""

    recompile_s: float = 60.0  # a new mesh compiled on the spot (the runtime measures it)
    warm_s: float = 0.0  # a new mesh whose program was compiled ahead of time
    prepared: frozenset[tuple] = frozenset()  # Plan.mesh_key() of the meshes compiled ahead
    layer_slots: int | None = None  # the current program's slots: splits within them are
    microbatch_slots: int | None = None  # free; None: any split of the same mesh is free
    reshard_bytes_per_s: float = 25e9  # per receiving device, in-memory device_put
    state_bytes_per_param: float = 16.0  # bf16 param + fp32 master + two fp32 Adam moments
    device_mtbf_hours: float = 50_000.0  # ~3 h job MTBF at 16k GPUs, as large fleets report
    horizon_s: float | None = None  # expected seconds to the next failure; None: from MTBF
    # A new mesh's program may compile in the background while the best plan the current
    # program can run trains meanwhile: the compile then costs only the throughput that
    # interim plan lacks, not a stall (the runtime does this for fail-slow re-plans).
    background: bool = False

    def __post_init__(self) -> None:
        for name in ("recompile_s", "warm_s", "reshard_bytes_per_s", "state_bytes_per_param",
                     "device_mtbf_hours"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"SwitchCosts.{name}={getattr(self, name)!r}: must be >= 0")
        if self.horizon_s is not None and not self.horizon_s > 0:
            raise ConfigError(f"SwitchCosts.horizon_s={self.horizon_s!r}: must be > 0")

    def expected_horizon_s(self, n_devices: int) -> float:
        """Seconds until the next failure of `n_devices` with independent failures."""
        if self.horizon_s is not None:
            return self.horizon_s
        return self.device_mtbf_hours * 3600.0 / max(1, n_devices)


@dataclass(frozen=True)
class PlanningContext:
    """Everything a policy needs besides the current plan and the health map."""

    model: ModelFacts
    costs: CostParams
    device_memory_bytes: float
    pool: tuple[int, ...]  # every device the job may use; capacity is measured over these
    schedule: str = "gpipe"
    remat: bool = True
    switch: SwitchCosts = field(default_factory=SwitchCosts)
    simulate_top: int = 6  # candidates (beyond the current mesh's) scored by the simulator
    # meshes with fewer DP groups are left out while the devices allow this many: with two,
    # every shard keeps a copy in another group, so a dead process loses no step
    min_dp: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "pool", tuple(int(d) for d in self.pool))
        if not self.pool or len(set(self.pool)) != len(self.pool) or min(self.pool) < 0:
            raise ConfigError(f"PlanningContext.pool={self.pool[:8]}...: needs distinct "
                              "device ids >= 0")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"PlanningContext.schedule={self.schedule!r}: valid are "
                              f"{', '.join(SCHEDULES)}")
        if not self.device_memory_bytes > 0:
            raise ConfigError(f"PlanningContext.device_memory_bytes="
                              f"{self.device_memory_bytes!r}: must be > 0")
        if self.min_dp < 1:
            raise ConfigError(f"PlanningContext.min_dp={self.min_dp}: must be >= 1")
        if self.simulate_top < 1:
            raise ConfigError(f"PlanningContext.simulate_top={self.simulate_top}: must be >= 1")

    @classmethod
    def for_plan(cls, plan: Plan, model: ModelFacts, costs: CostParams,
                 device_memory_bytes: float, pool: Sequence[int] | None = None,
                 **options: object) -> PlanningContext:
        """Context whose pool defaults to the plan's own devices."""
        ids = plan.device_ids if pool is None else tuple(pool)
        return cls(model, costs, device_memory_bytes, tuple(ids), **options)  # type: ignore[arg-type]


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


def keeps_current(policy: Policy) -> Policy:
    """`policy` behind the check every policy starts with: the current plan is kept when none
    of its devices is faulty (faulty spares do not matter)."""
    @functools.wraps(policy)
    def checked(current: Plan, health: Health, ctx: PlanningContext) -> Proposal:
        if faulty_in(current.device_ids, health):
            return policy(current, health, ctx)
        return Proposal(current, "no faults on the plan's devices: kept the current plan")
    return checked
