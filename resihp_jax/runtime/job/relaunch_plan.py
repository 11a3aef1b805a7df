"""The plan an incarnation of a job runs: the one asked for where its devices allow it, else
the scheduler's best plan on them.

A relaunch after a fail-stop has fewer devices than the requested plan needs: the plan is laid
over those there are, stand-ins for the missing ones priced as dead (the messages say
missing: their process was excluded, never started or did not join), and the scheduler
re-plans it as after a death in place, for the same global batch. Devices of hosts the health
record saw slow are priced slow.
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence

from resihp_jax.errors import PlanError
from resihp_jax.plan import Plan
from resihp_jax.models.config import ModelConfig
from resihp_jax.perfmodel import CostParams, Health
from resihp_jax.scheduler import PlanningContext, run_policy


# what a relaunch plans devices that report no memory with (CPU devices: a generous figure,
# as the requested plan already ran there)
RELAUNCH_DEFAULT_MEMORY_GB = 80.0


def plan_for_devices(requested: Plan, model: ModelConfig, device_ids: Sequence[int], *,
                     slow: Mapping[int, float] | None = None,
                     device_memory_gb: float = RELAUNCH_DEFAULT_MEMORY_GB,
                     remat: bool = False, policy: str = "resihp") -> tuple[Plan, str]:
    """(plan, why): `requested` on the first of `device_ids`, or the scheduler's pick."""
    ids = [int(d) for d in device_ids]
    if not ids:
        raise PlanError("no usable devices: every device of the job is excluded")
    slow = {d: f for d, f in (slow or {}).items() if d in ids and f > 1}
    n = requested.n_devices
    if not slow and set(requested.device_ids) <= set(ids):
        return requested, "as requested"  # its own placement, when every device is usable
    if len(ids) >= n and not slow:
        return requested.replace(device_ids=tuple(ids[:n])), "as requested"
    top = max(ids) + 1
    stand_ins = list(range(top, top + max(0, n - len(ids))))
    current = requested.replace(device_ids=tuple((ids + stand_ins)[:n]))
    health = Health().with_changes(dead=stand_ins,
                                           compute={d: 1.0 / f for d, f in slow.items()})
    # a job asked to run with DP replicas keeps two where it can: a relaunch on one plan
    # with a single copy of each shard would lose steps at the next death (survivor_copies)
    context = PlanningContext(model, CostParams.for_model(model), device_memory_gb * 2**30,
                              tuple(ids + stand_ins), remat=remat, min_dp=min(2, requested.dp))
    outcome = run_policy(policy, current, health, context)
    if outcome.plan is None or set(outcome.plan.device_ids) - set(ids):
        raise PlanError(f"no plan of {model.name} fits the {len(ids)} usable device(s): "
                        f"{_missing_not_dead(outcome.reason, stand_ins)}")
    if not stand_ins:
        return outcome.plan, (f"scheduler's plan (devices {sorted(slow)} were seen slow): "
                              f"{outcome.reason}")
    # the missing devices are not dead (a process excluded, never started or not joined):
    # the scheduler's own words about dead devices and a switch would mislead
    return outcome.plan, (f"scheduler's plan for the {len(ids)} usable device(s): "
                          f"{outcome.plan.describe()} (the requested {requested.describe()} "
                          f"needs {n}{', some seen slow' if slow else ''})")


def _missing_not_dead(reason: str, stand_ins: list[int]) -> str:
    return reason.replace("dead device", "missing device") if stand_ins else reason


def cover_processes(plan: Plan, process_of: Mapping[int, int]) -> Plan:
    """`plan` with devices swapped so every process holds at least one of its devices.

    In a multi-controller job every process takes part in every program and every
    checkpoint read, and a process with no device in the mesh cannot (orbax cannot restore
    an array with no shard on it). A plan on fewer devices than the job has may leave a
    process out; this trades a used device of a process with several for an unused one of
    the process left out (equal devices, so the plan's cost is unchanged).
    """
    ids = list(plan.device_ids)
    processes = set(process_of.values())
    if len(ids) < len(processes):
        raise PlanError(f"plan {plan.describe()} uses {len(ids)} devices, but each of the job's "
                        f"{len(processes)} processes needs at least one: run fewer processes")
    for proc in sorted(processes):
        held = Counter(process_of[d] for d in ids)
        if held[proc]:
            continue
        spare = next(d for d in sorted(process_of) if process_of[d] == proc and d not in ids)
        # give up a device of the process holding the most, the last one it holds
        donor = max(held, key=lambda p: (held[p], -p))
        slot = max(i for i, d in enumerate(ids) if process_of[d] == donor)
        ids[slot] = spare
    return plan.replace(device_ids=tuple(ids))
