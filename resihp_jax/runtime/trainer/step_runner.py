"""One step of the resilient loop, guarded and timed, and what runs beside it.

`StepRunner.step` runs the current program under a hang deadline (detector/failstop.py
`run_guarded`); while the devices work, the loop's thread judges the step before (watching.py)
and predicts this batch's healthy time, its deadline. `Host` is what the current plan's
programs call back into (its fault hook, its stage timer); `Probe` is the detector's prober.
"""

from __future__ import annotations

import dataclasses

import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from resihp_jax.data import GlobalBatch
from resihp_jax.detector import (ProbeResult, Prober, StepObservation, Verdict,
                                 run_guarded)
from resihp_jax.detector.attention_work import mb_attention_l2
from resihp_jax.detector.base import Detector
from resihp_jax.detector.probes import gathered_probe
from resihp_jax.errors import ConfigError
from resihp_jax.meshes.agree import multi_process
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.plan import Plan
from resihp_jax.runtime.config import DETECTOR_OFF, ResilienceConfig
from resihp_jax.runtime.events import StepRecord
from resihp_jax.runtime.programs.keeper import ProgramKeeper
from resihp_jax.runtime.replicas.protocol import Replicas
from resihp_jax.runtime.recovery.checkpoint import Checkpointer, deadline_beside_write
from resihp_jax.runtime.trainer.agreement import agreed, agreed_step
from resihp_jax.runtime.trainer.host_cpu import CpuMeter
from resihp_jax.runtime.trainer.records import device_batch
from resihp_jax.runtime.trainer.sampling import TimingSampler
from resihp_jax.runtime.trainer.timing import StageTimer, StepTiming, timed_step
from resihp_jax.runtime.trainer.watching import Judging
from resihp_jax.step.instrument import OFF, FaultHook
from resihp_jax.step.program import TrainState


class Host:
    """The one Instrument host every program of a trainer calls: the current plan's fault hook
    and stage timer, so a program compiled ahead needs no rebuild when its plan is current."""

    def __init__(self, fault_hook: FaultHook | None) -> None:
        self.fault_hook = fault_hook
        self.plan: Plan | None = None
        self.hook: FaultHook | None = None
        self.timer: StageTimer | None = None

    def __call__(self, *event: Any) -> None:
        if self.hook is not None:
            self.hook(*event)  # first: its injected delay belongs in the timed region
        if self.timer is not None:
            self.timer(*event)

    def use(self, plan: Plan) -> None:
        """`plan` runs from now on: its fault hook, and a fresh stage timer for its grid."""
        self.plan = plan
        self.hook = self.fault_hook.with_plan(plan) if self.fault_hook else None
        self.timer = StageTimer((plan.dp, plan.pp, plan.tp), cpu=CpuMeter())

    def knobs(self, step: int, timed: bool = True) -> np.ndarray | None:
        """The hook's per-device knobs for this step (None: healthy); it may raise a stop.
        Not `timed`: every device the hook does not slow is `OFF` (no callbacks)."""
        knobs = self.hook.knobs(step) if self.hook is not None else None
        if timed:
            return knobs
        grid = np.ones((self.plan.dp, self.plan.pp, self.plan.tp), np.float32) \
            if knobs is None else np.asarray(knobs, np.float32)
        return np.where(grid > 1.0, grid, np.float32(OFF))

    def in_flight(self) -> tuple[int, ...]:
        """Ids of the devices that started their timed work and never finished it."""
        grid = self.plan.device_grid()
        return tuple(int(grid[c]) for c in self.timer.in_flight())


class Probe:
    """The detector's prober: times each device of the current plan. `spent["probes"]` and
    `runs` count what the probes cost the step loop."""

    def __init__(self, devices: Sequence[jax.Device], host: Host, spent: dict[str, float],
                 clock: Callable[[], float],
                 on_long_work: Callable[[str], None] | None = None) -> None:
        self.devices, self.host, self.spent, self.clock = devices, host, spent, clock
        self.on_long_work = on_long_work
        self.runs = 0
        self._prober: Prober | None = None

    def forget(self) -> None:
        """A new program runs: its first alarm builds a prober for its plan."""
        self._prober = None

    def __call__(self, step: int) -> ProbeResult:
        if self.on_long_work is not None:
            self.on_long_work("probe")
        if self._prober is None:  # (its compile is a one-off, not a run's cost)
            self._prober = Prober(self.host.plan, self.devices, host=self.host.hook)
        started = self.clock()
        result = self._prober.run(self.host.knobs(step))
        if multi_process():
            result = gathered_probe(result, self.host.plan.device_ids)
        self.spent["probes"] += self.clock() - started
        self.runs += 1
        return result


class StepRunner:
    """Runs the trainer's steps on `keeper`'s current program, each guarded, timed, judged
    beside the next; `spent`: the step loop's account of what resilience cost (overhead.py)."""

    def __init__(self, model: ModelFacts, config: ResilienceConfig, keeper: ProgramKeeper,
                 host: Host, detector: Detector, checkpointer: Checkpointer | None,
                 sampler: TimingSampler, spent: dict[str, float], replicas: Replicas,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.model, self.config, self.keeper, self.host = model, config, keeper, host
        self.detector, self.checkpointer, self.sampler = detector, checkpointer, sampler
        self.spent, self.replicas, self.clock = spent, replicas, clock
        self.state: TrainState | None = None
        self.completed: int | None = None  # the newest step done on the devices
        # what the newest step will be judged against, worked out beside it (None: none yet)
        self.last_prediction_s: float | None = None
        self.last_timing: StepTiming | None = None  # (its stage times None: ran untimed)
        self._last_l2_M = np.zeros(0)  # the newest step's attention work per micro-batch
        self._step_timed = True  # whether the last step ran its stage-timing callbacks
        self._last_plan: Plan | None = None  # the newest step's (its replica's share)

    def step(self, step: int, batch: GlobalBatch, beside: Judging | None = None
             ) -> tuple[StepRecord, Verdict | None] | None:
        """Run step `step` on `batch` to completion; `beside`: the previous step's judgement,
        made meanwhile, whose agreed verdict comes back with the step's record. None: the
        replicas did not commit the step, and `state` is again the one before it (the caller
        runs its batch again; `beside` was not concluded). StepFailed: it failed or hung."""
        program, timer = self.keeper.program, self.host.timer
        whole_crc = batch.content_crc  # the record names the global batch, not the share
        plan, batch = self.replicas.share(self.keeper.plan, batch)
        if plan != program.plan:  # this replica's share of the global batch (no recompile)
            program = program.with_plan(plan)
        arrays = device_batch(program, batch)
        instrumented = self.keeper.instrumented
        in_doubt = self.detector.wants_stage_times()
        timed = instrumented and self.sampler.wants(in_doubt)
        self._step_timed = timed
        before = self.state
        dispatched = threading.Event()

        def run_once() -> tuple[TrainState, dict[str, Any], StepTiming]:
            try:
                return timed_step(program, before, arrays, self.host.knobs(step, timed),
                                  timer, dispatched, run=self.replicas.run)
            finally:
                dispatched.set()  # (also when it failed before dispatching)

        l2_M: list[np.ndarray] = []

        def deadline() -> float:
            # host work while the devices run the step, once it is dispatched (before, this
            # thread's Python would hold up the step's own): the previous step's judgement,
            # this batch's healthy time (its deadline)
            dispatched.wait(self.config.hang_floor_s)
            if beside is not None:
                beside.judge()
            l2_M.append(mb_attention_l2(self.model, batch))
            self.last_prediction_s = self.detector.prediction_s(plan, mb_tokens(plan), l2_M[0])
            return self.deadline_s(batch, l2_M[0], plan)

        spent_before = timer.spent_s
        self.state, metrics, timing = run_guarded(run_once, step, deadline,
                                                  in_flight=self.host.in_flight)
        self.spent["timing"] += timer.spent_s - spent_before
        if not self.replicas.should_commit(step):  # back to the state before the step
            if _deleted(before):  # the step donated it
                raise ConfigError(f"the replicas did not commit step {step}, and the step "
                                  "donated the state to go back to: "
                                  "StepConfig(donate_state=False) keeps it")
            self.state = before
            return None
        # done on the devices: should a later collective of this step fail (a peer died
        # meanwhile), this process can still keep it, as peers that got further did
        self.completed = step
        # the previous step's verdict: its probes, if any, use the devices this step has left
        verdict = self.verdict(beside, agree=False)
        if multi_process() and watches(self.config):  # every detector sees the same step
            timing, verdict = agreed_step(timing, verdict)
        if instrumented:
            self.sampler.observe(timed, timing.step_time_s, timer.spent_s - spent_before,
                                 in_doubt=in_doubt)
        self.last_timing = timing
        self._last_l2_M, self._last_plan = l2_M[0], plan
        record = StepRecord.of(int(self.state.step), plan, jax.device_get(metrics),
                               timing.step_time_s, batch)
        return dataclasses.replace(record, batch_crc=whole_crc), verdict

    def deadline_s(self, batch: GlobalBatch, l2_M: np.ndarray | None = None,
                   plan: Plan | None = None) -> float:
        """How long this batch's step may take before it counts as hung (worked out while
        the devices run the step); `l2_M`: the batch's attention work, when already known."""
        plan = plan or self.keeper.plan
        l2_M = mb_attention_l2(self.model, batch) if l2_M is None else l2_M
        predicted = self.detector.healthy_time_s(plan, mb_tokens(plan), l2_M)
        if predicted is None:
            return self.config.step_timeout_s
        deadline = max(self.config.hang_floor_s, self.config.hang_factor * predicted)
        # an asynchronous write under way may hold the host: the step gets its length too
        return deadline_beside_write(self.checkpointer, deadline, self.config.step_timeout_s)

    def observation(self, record: StepRecord) -> StepObservation:
        """The step just run, as the detector judges it (on the plan of its share)."""
        plan = self._last_plan
        return StepObservation(record.step, plan, mb_tokens(plan), self._last_l2_M,
                               record.step_time_s, self.last_timing.stage_DxP,
                               self.last_timing.host_cpu)

    def verdict(self, judging: Judging | None, agree: bool = True) -> Verdict | None:
        """`judging`'s verdict, the same on every process (not `agree`d: this process's own);
        the time the loop waited for it, the probes excluded, is the detector's."""
        if judging is None:
            return None
        judging_from, probes_before = self.clock(), self.spent["probes"]
        verdict = judging.verdict()
        # nothing watched: no verdict on any process, nothing to agree on (a collective
        # a step less: on gloo a tenth of a second)
        if agree and watches(self.config):
            verdict = agreed(verdict)
        self.spent["detector"] += (self.clock() - judging_from
                                   - (self.spent["probes"] - probes_before))
        return verdict

    def untimed_hint(self) -> str:
        """Why a failed step named no device, where it ran untimed ('' where it ran timed)."""
        return ("; it ran without stage timing, which names a device that hangs "
                "(ResilienceConfig(stage_timing_every=1) times every step)"
                if not self._step_timed and self.keeper.instrumented else "")


def _deleted(state: TrainState) -> bool:
    return any(leaf.is_deleted() for leaf in jax.tree.leaves(state)
               if isinstance(leaf, jax.Array))


def watches(config: ResilienceConfig) -> bool:
    """Does a detector watch the steps? Off, each process times its own steps for its own
    deadlines, and no verdict needs agreeing."""
    return config.detector != DETECTOR_OFF


def mb_tokens(plan: Plan) -> np.ndarray:
    """The tokens of each micro-batch of `plan`'s global batch, padding included."""
    return np.full(plan.n_microbatches, plan.microbatch_size * plan.seq_len, np.float64)
