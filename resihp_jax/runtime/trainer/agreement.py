"""One view and one decision in a job of several processes: process 0's.

Identical inputs give every process identical verdicts, but a split decision (two processes
running different programs in a step) must be impossible, not merely unlikely: what decides
the job's next step (a verdict, a plan, a background program ready) is process 0's on every
process, and a step's timing the slowest process's. In one process each is the identity.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from resihp_jax.detector import Verdict
from resihp_jax.meshes.agree import (bytes_from_primary, from_payload, from_primary,
                                     multi_process, primary_payload)
from resihp_jax.plan import Plan
from resihp_jax.runtime.trainer.timing import StepTiming


def primary_says(ready: bool) -> bool:
    """Process 0's `ready` on every process."""
    return bool(from_primary(ready or None)) if multi_process() else ready


def agreed(verdict: Verdict | None) -> Verdict | None:
    """Process 0's verdict on every process."""
    if not multi_process():
        return verdict
    return _verdict_of(from_primary(None if verdict is None else dataclasses.asdict(verdict)))


def agreed_step(timing: StepTiming, verdict: Verdict | None
                ) -> tuple[StepTiming, Verdict | None]:
    """The step's timing as the whole job saw it and process 0's `verdict` on the step
    before, in one all-gather: the size of process 0's verdict rides along with the timing
    (the other processes send 0), and only a step with a verdict (rare) broadcasts its bytes.
    One collective a step where two were (each a host round-trip; on gloo 0.1 s)."""
    payload = primary_payload(None if verdict is None else dataclasses.asdict(verdict))
    timing, (size,) = timing.gathered_with((float(len(payload)),))
    return timing, _verdict_of(from_payload(bytes_from_primary(payload, int(size))))


def primary_plans(new: Plan, interim: Plan | None) -> tuple[Plan, Plan | None]:
    """Process 0's plan and interim plan on every process."""
    got = from_primary({"plan": new.to_dict(),
                        "interim": None if interim is None else interim.to_dict()})
    return Plan.from_dict(got["plan"]), (None if got["interim"] is None
                                         else Plan.from_dict(got["interim"]))


def warm_up_agreement(plan: Plan) -> None:
    """Build now the small programs of a job's per-step agreement, so the first step (on a
    relaunch's critical path) compiles none of them."""
    if multi_process():
        agreed_step(StepTiming(0.0, np.zeros((plan.dp, plan.pp, plan.tp))), None)
        from_primary(None)  # (the last step's verdict, the checkpoints' decisions)


def _verdict_of(fields: dict[str, Any] | None) -> Verdict | None:
    return None if fields is None else Verdict(**{**fields, "devices": tuple(fields["devices"])})
