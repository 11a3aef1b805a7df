"""ResilientTrainer: train, watch every step, and re-plan around slow or stopped devices.

Each step: take the next global batch, run it (guarded by a timeout), hand its timing and
its exact batch to the detector. A verdict updates the health map; the scheduler proposes a
plan; if it differs, the state moves onto it (in memory, or from the latest checkpoint when
a device stopped and a checkpoint exists) and training continues from the same data
position. A step that failed is re-run on the new plan with the same batch, so no data is
skipped or repeated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np

from resihp_jax.data import BatchIterator, GlobalBatch
from resihp_jax.detector import (Prober, StepFailed, StepObservation, Verdict, make_detector,
                                 run_guarded)
from resihp_jax.meshes.plan import Plan
from resihp_jax.model.config import ModelConfig
from resihp_jax.perfmodel import CostParams, Health
from resihp_jax.runtime.checkpoint import Checkpointer
from resihp_jax.runtime.faults import FaultHook, chain_hosts
from resihp_jax.runtime.loop import StepRecord
from resihp_jax.runtime.timing import StageTimer, timed_step
from resihp_jax.scheduler import PlanningContext, SwitchCosts, run_policy
from resihp_jax.train.config import TrainConfig
from resihp_jax.train.instrument import Instrument
from resihp_jax.train.reshard import move_state
from resihp_jax.train.step import StepProgram, TrainState, build_step


@dataclass(frozen=True)
class ResilienceConfig:
    detector: str = "resihp"
    policy: str = "resihp"
    step_timeout_s: float = 120.0  # a hung step counts as stopped after this long
    device_memory_gb: float = 4.0
    recompile_s: float = 10.0  # what the scheduler charges a new mesh
    horizon_s: float = 3600.0  # expected seconds to the next failure
    checkpoint_dir: str | None = None
    checkpoint_interval: int = 10


@dataclass(frozen=True)
class Replan:
    """What happened when the trainer reacted to a verdict."""
    step: int
    verdict: Verdict
    old_plan: Plan
    new_plan: Plan
    reason: str
    switch_s: float  # wall time to move the state and build the new program
    restored_from_step: int | None = None  # set when the state came from a checkpoint


@dataclass
class _Mesh:
    """Everything bound to the current plan."""
    program: StepProgram
    hook: FaultHook | None
    timer: StageTimer
    prober: Prober


@dataclass
class ResilientTrainer:
    model: ModelConfig
    train_cfg: TrainConfig
    plan: Plan
    devices: Sequence[jax.Device]
    data: BatchIterator
    config: ResilienceConfig = field(default_factory=ResilienceConfig)
    fault_hook: FaultHook | None = None  # tests, benchmarks and the demo inject faults here
    clock: Callable[[], float] = time.perf_counter

    def __post_init__(self) -> None:
        self.health = Health.healthy()
        self._mesh = self._bind(self.plan)
        self.detector = make_detector(self.config.detector, prober=self._probe,
                                      model=self.model, clock=self.clock)
        self.checkpointer = (Checkpointer(self.config.checkpoint_dir,
                                          interval=self.config.checkpoint_interval)
                             if self.config.checkpoint_dir else None)
        self.state: TrainState | None = None
        self.replans: list[Replan] = []

    @property
    def program(self) -> StepProgram:
        return self._mesh.program

    def _bind(self, plan: Plan) -> _Mesh:
        hook = self.fault_hook.with_plan(plan) if self.fault_hook is not None else None
        timer = StageTimer((plan.dp, plan.pp, plan.tp))
        train_cfg = self.train_cfg.replace(microbatch_slots=max(plan.microbatches_per_group))
        program = build_step(self.model, train_cfg, plan, self.devices,
                             instrument=Instrument(chain_hosts(hook, timer)))
        return _Mesh(program, hook, timer, Prober(plan, self.devices, host=hook))

    def _knobs(self, step: int) -> np.ndarray | None:
        """The hook's per-device knobs for this step (None: healthy); it may raise a stop."""
        return self._mesh.hook.knobs(step) if self._mesh.hook is not None else None

    def _probe(self, step: int):  # noqa: ANN202 - a ProbeResult
        return self._mesh.prober.run(self._knobs(step))

    # ---- the loop ----------------------------------------------------------------------
    def run(self, steps: int, seed: int = 0) -> Iterator[StepRecord | Replan]:
        """Train `steps` steps, yielding each step's record and each re-plan."""
        if self.state is None:
            self.state = self.program.init_state(seed)
        done = int(self.state.step)
        while done < steps:
            data_before = self.data.state()
            batch = self.data.next_batch()
            try:
                record = self._step(done + 1, batch)
            except StepFailed as failed:
                yield self._react(failed.verdict, data_before)
                continue  # the data iterator was rewound: the same batch runs again
            done = record.step
            if self.checkpointer:
                self.checkpointer.save(done, self.state, self.program, self.data.state())
            # judged before it is yielded, so the caller sees this step's prediction
            verdict = self.detector.observe(self._observation(record, batch))
            yield record
            if verdict is not None:
                yield self._react(verdict, None)
        if self.checkpointer:
            self.checkpointer.wait()

    def _step(self, step: int, batch: GlobalBatch) -> StepRecord:
        mesh = self._mesh
        arrays = mesh.program.shard_batch(batch.tokens_MxBxS, batch.segment_ids_MxBxS,
                                          batch.positions_MxBxS)

        def run_once() -> tuple[TrainState, dict[str, Any], Any]:
            return timed_step(mesh.program, self.state, arrays, self._knobs(step),
                              mesh.timer)

        self.state, metrics, timing = run_guarded(run_once, step, self.config.step_timeout_s,
                                                  in_flight=self._in_flight)
        self._last_timing = timing
        return StepRecord.of(int(self.state.step), self.plan, jax.device_get(metrics),
                             timing.step_time_s, batch)

    def _in_flight(self) -> tuple[int, ...]:
        grid = self.plan.device_grid()
        return tuple(int(grid[c]) for c in self._mesh.timer.in_flight())

    def _observation(self, record: StepRecord, batch: GlobalBatch) -> StepObservation:
        mb_tokens = np.full(self.plan.n_microbatches, self.plan.microbatch_size
                            * self.plan.seq_len, np.float64)
        return StepObservation(record.step, self.plan, mb_tokens, batch.sum_sq_lengths(),
                               record.step_time_s, self._last_timing.stage_DxP)

    # ---- reacting to a verdict -------------------------------------------------------------
    def _react(self, verdict: Verdict, data_before: dict[str, Any] | None) -> Replan:
        self.health = _updated_health(self.health, verdict)
        outcome = run_policy(self.config.policy, self.plan, self.health, self._context())
        old, start = self.plan, self.clock()
        new = outcome.plan if outcome.plan is not None else old
        restored = None
        if new != old:
            mesh = self._bind(new)
            if verdict.kind == "stopped" and self.checkpointer and \
                    self.checkpointer.latest_step() is not None:
                got = self.checkpointer.restore(mesh.program)
                self.state, restored = got.state, got.step
                self.data.restore(got.data_state)
            else:
                self.state = move_state(self.state, self._mesh.program, mesh.program)
                if data_before is not None:
                    self.data.restore(data_before)
            self._mesh, self.plan = mesh, new
        elif data_before is not None:
            self.data.restore(data_before)
        self.detector.rebaseline()
        replan = Replan(verdict.step, verdict, old, new, outcome.reason, self.clock() - start,
                        restored)
        self.replans.append(replan)
        return replan

    def _context(self) -> PlanningContext:
        costs = self.detector.cost_params() or CostParams.for_model(self.model)
        return PlanningContext(
            self.model, costs, self.config.device_memory_gb * 2**30,
            tuple(int(d.id) for d in self.devices), schedule="gpipe",
            remat=self.train_cfg.remat,
            switch=SwitchCosts(recompile_s=self.config.recompile_s,
                               horizon_s=self.config.horizon_s))


def _updated_health(health: Health, verdict: Verdict) -> Health:
    if verdict.kind == "stopped":
        return health.with_changes(dead=verdict.devices)
    update = {d: 1.0 / max(verdict.slowdown, 1.0) for d in verdict.devices}
    if verdict.kind == "link":
        return health.with_changes(link=update)
    return health.with_changes(compute=update)
