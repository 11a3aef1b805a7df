"""`plan="auto"`: the scheduler's best plan for the devices present and a global batch.

The scheduler searches for a fixed micro-batch count and size; a user's batch fixes only its
rows and row length, so every way of cutting the rows into micro-batches is searched too and
the predicted fastest plan wins. Deterministic: every process of a job computes the same plan.
"""

from __future__ import annotations

from typing import Sequence

from resihp_jax.errors import PlanError
from resihp_jax.plan import Plan
from resihp_jax.perfmodel import CostParams, Health
from resihp_jax.perfmodel.costs import REMAT_POLICIES
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.scheduler import PlanningContext, search_plans

MAX_MICROBATCH_SIZES = 6  # the divisors of the rows tried as micro-batch sizes, smallest first


def microbatch_sizes(rows: int) -> list[int]:
    """Micro-batch sizes that cut `rows` evenly, the smallest first (most micro-batches)."""
    return [d for d in range(1, rows + 1) if rows % d == 0][:MAX_MICROBATCH_SIZES]


def auto_plan(model: ModelFacts, device_ids: Sequence[int], rows: int, seq_len: int, *,
              device_memory_gb: float, remat: bool | str = False) -> tuple[Plan, float]:
    """(plan, predicted step seconds): the fastest plan of `rows` x `seq_len` batches on
    `device_ids` that fits `device_memory_gb` per device, by the scheduler's cost model."""
    ids = tuple(int(d) for d in device_ids)
    if not ids:
        raise PlanError("plan='auto': no devices to plan for")
    best: tuple[float, Plan] | None = None
    for size in microbatch_sizes(rows):
        seed = Plan.uniform(1, 1, 1, n_layers=model.n_layers, n_microbatches=rows // size,
                            microbatch_size=size, seq_len=seq_len, device_ids=ids[:1])
        context = PlanningContext(model, CostParams.for_model(model), device_memory_gb * 2**30,
                                  ids, remat=remat)
        for candidate in search_plans(seed, Health(), context)[:1]:
            if best is None or candidate.step_time_s < best[0]:
                best = (candidate.step_time_s, candidate.plan)
    if best is None:
        raise PlanError(f"plan='auto': no plan of the model ({model.n_layers} layers, batches "
                        f"of {rows} x {seq_len}) fits {len(ids)} device(s) of "
                        f"{device_memory_gb:g} GB; give a Plan, or more devices")
    return best[1], best[0]


def auto_plan_and_remat(model: ModelFacts, device_ids: Sequence[int], rows: int, seq_len: int,
                        *, device_memory_gb: float) -> tuple[Plan, str]:
    """`plan="auto"` with `remat="auto"`: the fastest plan under the least recomputing policy
    that admits one (recomputation is charged in time, so a policy that saves memory is taken
    only where the devices need it)."""
    for policy in REMAT_POLICIES[:-1]:
        try:
            return auto_plan(model, device_ids, rows, seq_len, device_memory_gb=device_memory_gb,
                             remat=policy)[0], policy
        except PlanError:
            continue
    return auto_plan(model, device_ids, rows, seq_len, device_memory_gb=device_memory_gb,
                     remat=REMAT_POLICIES[-1])[0], REMAT_POLICIES[-1]
