"""Process 0's metrics of one run: each step's record and the events around it (plan changes,
verdicts, re-plans and their gain, checkpoints), handed to `Metrics` (resihp_jax/metrics),
which writes them off the loop's path. A step's entry adds what the loop has anyway: the
detector's prediction, MFU where the device's peak is known, and the learning rate where the
optimizer is an optax `inject_hyperparams` one (every preset's is).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from resihp_jax.plan import Plan
from resihp_jax.metrics import Metrics
from resihp_jax.metrics.entry import (checkpoint_entry, peak_flops, plan_entry, replan_entry,
                                      step_entry, step_flops, verdict_entry)
from resihp_jax.runtime.config import RunConfig
from resihp_jax.runtime.events import Replan, StepRecord

# (step, state) -> the learning rate that step applied, or None
LearningRate = Callable[[int, Any], "float | None"]


class RunMetrics:
    def __init__(self, metrics: Metrics, model: Any = None,
                 learning_rate: LearningRate | None = None) -> None:
        import jax  # noqa: PLC0415

        self.metrics, self.model, self.learning_rate = metrics, model, learning_rate
        self.peak = peak_flops(getattr(jax.devices()[0], "device_kind", ""))
        self._plan: dict | None = None
        self._verdict: Any = None
        self._saves_seen = 0
        self._step = 0

    @classmethod
    def open(cls, config: RunConfig, start: int, start_record: dict | None, *,
             model: Any = None, learning_rate: LearningRate | None = None,
             say: Callable[[str], None] | None = None) -> RunMetrics:
        metrics = Metrics(config.metrics, start=start, start_record=start_record,
                          profile_steps=config.profile_steps, say=say)
        run = cls(metrics, model, learning_rate)
        run._step = start
        metrics.between_steps(start)  # a profile from the first step starts now
        return run

    def step(self, record: StepRecord, *, predicted_s: float | None = None, state: Any = None,
             checkpointer: Any = None) -> None:
        t0 = time.perf_counter()
        self._step = record.step
        if record.plan != self._plan:
            self._plan = record.plan
            plan = Plan.from_dict(record.plan)
            self.metrics.put(plan_entry(record.step, f"{plan.describe()} on devices "
                                        f"{list(plan.device_ids)}"))
        lr = self.learning_rate(record.step, state) if self.learning_rate is not None else None
        self.metrics.put(step_entry(record.to_json(), predicted_s=predicted_s,
                                    mfu=self._mfu(record), learning_rate=lr))
        self._checkpoints(checkpointer, state)
        self.metrics.loop_s += time.perf_counter() - t0
        self.metrics.between_steps(record.step)

    def _mfu(self, record: StepRecord) -> float | None:
        if self.peak is None or self.model is None or record.step_time_s <= 0:
            return None
        devices = Plan.from_dict(record.plan).n_devices
        flops = step_flops(self.model, record.tokens, record.sum_sq_lengths)
        return flops / record.step_time_s / (devices * self.peak)

    def _checkpoints(self, checkpointer: Any, state: Any) -> None:
        """Each save since the last look, as an event at the current step."""
        if checkpointer is None:
            return
        saved = checkpointer.stats.saved[self._saves_seen:]
        self._saves_seen += len(saved)
        size = state_bytes(state) if saved else None
        for step, blocking_s, _ in saved:
            self.metrics.put(checkpoint_entry(self._step, step, blocking_s, size))

    def replan(self, replan: Replan) -> None:
        t0 = time.perf_counter()
        verdict = replan.verdict
        if verdict is not self._verdict:  # (a switch that waited for its compile: seen)
            self._verdict = verdict
            self.metrics.put(verdict_entry(replan.step, verdict.devices, verdict.kind,
                                           verdict.slowdown))
        self.metrics.put(replan_entry(replan.step, replan.old_plan.describe(),
                                      replan.new_plan.describe(), how=replan.kind,
                                      reason=replan.reason, switch_s=replan.switch_s,
                                      predicted_gain=replan.predicted_gain))
        self.metrics.loop_s += time.perf_counter() - t0
        if replan.new_plan != replan.old_plan:
            self.metrics.replanned(replan.step, replan.predicted_gain)

    def close(self, checkpointer: Any = None, state: Any = None) -> None:
        """The saves after the last step (the final one), then wait for every entry."""
        self._checkpoints(checkpointer, state)
        self.metrics.close(self._step)


def state_bytes(state: Any) -> int | None:
    """The bytes of a training state (its arrays' shapes and types; nothing is fetched)."""
    if state is None:
        return None
    import jax  # noqa: PLC0415

    try:
        return int(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state)))
    except AttributeError:
        return None


def optimizer_learning_rate(step: int, state: Any) -> float | None:
    """The learning rate an optax `inject_hyperparams` optimizer holds in `state`, on its own
    or anywhere inside a chain (the rate of the update that made `state`; a float fetched
    from the device; None when the optimizer exposes none)."""
    found = _hyperparams(getattr(state, "opt_state", None))
    if found is None:
        return None
    shards = getattr(found, "addressable_shards", None)  # (a job's array: this process's)
    return float(shards[0].data if shards else found)


def _hyperparams(opt_state: Any) -> Any:
    hyper = getattr(opt_state, "hyperparams", None)
    if isinstance(hyper, dict) and "learning_rate" in hyper:
        return hyper["learning_rate"]
    parts = opt_state if isinstance(opt_state, (tuple, list)) else ()
    return next((found for found in map(_hyperparams, parts) if found is not None), None)
