"""ResilientTrainer: train, watch every step, and re-plan around slow or stopped devices.

A failed step re-runs on the new plan with the same batch, so no data is skipped or
repeated. The trainer is the loop (`run`) wiring its parts (docs/DESIGN.md, "trainer/").

`responsive_loop`: the loop lets go of the GIL at each wait on the devices and by default
gets it back from a background thread (compiles, layout moves, orbax's and the copies'
writers, the step guard) only after 5 ms (`sys.getswitchinterval`): ten waits a step lose up
to 50 ms, half the throughput of a 40 ms GPU step while compiles last (as on a 2,000-GPU
job; benchmarks/gil_contention.py: 21 ms steps taking 60-64 here). At 0.1 ms the price, a
thread switch every 0.1 ms, falls on the background work.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from typing import Any, Callable, Iterator, Sequence

import jax

from resihp_jax.data import BatchIterator, GlobalBatch
from resihp_jax.detector import StepFailed, Verdict, make_detector
from resihp_jax.detector.base import Detector
from resihp_jax.errors import ConfigError, JobStepFailed, StepHung
from resihp_jax.meshes.agree import multi_process
from resihp_jax.perfmodel import Health
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.plan import Plan
from resihp_jax.runtime.config import DETECTOR_OFF, ResilienceConfig
from resihp_jax.runtime.events import Replan, StepRecord, Switch
from resihp_jax.runtime.programs.keeper import ProgramKeeper, StepPrograms
from resihp_jax.runtime.recovery.checkpoint import Checkpointer
from resihp_jax.runtime.replicas.protocol import NoReplicas, Replicas
from resihp_jax.runtime.trainer.agreement import primary_says, warm_up_agreement
from resihp_jax.runtime.trainer.overhead import Overhead, run_overhead
from resihp_jax.runtime.trainer.records import diverged
from resihp_jax.runtime.trainer.replanner import Replanner
from resihp_jax.runtime.trainer.sampling import TimingSampler
from resihp_jax.runtime.trainer.step_runner import Host, Probe, StepRunner, watches
from resihp_jax.runtime.trainer.timing import StepTiming
from resihp_jax.runtime.trainer.watching import Judging, Unwatched
from resihp_jax.scheduler import PlanningContext
from resihp_jax.step.config import StepConfig
from resihp_jax.step.instrument import FaultHook, Instrument
from resihp_jax.step.program import StepProgram, TrainState
from resihp_jax.step.staging import HostStaging

SWITCH_INTERVAL_S = 1e-4  # the interpreter's default is 5e-3


class ResilientTrainer:
    """Trains `plan` on `devices`, watching every step; `run(n)` yields StepRecords and Replans.

    `model`: the facts of the model (perfmodel/facts.py); `programs`: what builds its step
    for each plan (keeper.py `StepPrograms`); `fault_hook`: where tests, benchmarks and the
    demo inject faults; `on_long_work`: told before work between steps that may take long (a
    probe, a switch), so a supervisor watching for progress can allow for it; `replicas`:
    the collaborator across replica groups (replicas.py; default: none)."""

    def __init__(self, model: ModelFacts, train_cfg: StepConfig, plan: Plan,
                 devices: Sequence[jax.Device], data: BatchIterator,
                 config: ResilienceConfig | None = None, fault_hook: FaultHook | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 on_long_work: Callable[[str], None] | None = None, *,
                 programs: StepPrograms, replicas: Replicas | None = None) -> None:
        # (a fresh default each time: its compile cache's directory reads the environment)
        config = ResilienceConfig() if config is None else config
        if fault_hook is not None and not config.stage_timing:
            raise ConfigError("a fault_hook acts through the stage-timing callbacks: "
                              "ResilienceConfig(stage_timing=True)")
        self.data, self.config, self.clock = data, config, clock
        # what resilience spent on the step loop's path (see overhead.py): saves (every
        # call, put-off checks included), probe runs, stage timing (the timers' own time)
        self.spent_s = {"checkpoints": 0.0, "detector": 0.0, "probes": 0.0, "timing": 0.0}
        self.sampler = TimingSampler(config.stage_timing_every, config.overhead_budget)
        host = Host(fault_hook)
        self.probe = Probe(devices, host, self.spent_s, clock, on_long_work)

        def installed(plan: Plan) -> None:  # a program runs `plan`: its timer, hook, prober
            host.use(plan)
            self.probe.forget()

        # host memory for a move onto a prepared mesh, touched while it is prepared (one
        # process only: a job of several moves through orbax)
        self.staging = HostStaging(budget_bytes=0 if multi_process() else None)
        # the step alone: the layout moves and every background compile wait for the first
        # step (`start_background`), so nothing competes with it for the host's cores
        self.keeper = ProgramKeeper(model, train_cfg, plan, devices, programs, config,
                                    Instrument(host), faults=fault_hook is not None,
                                    staging=self.staging, on_install=installed,
                                    compile_fn=getattr(replicas, "compile_step", None))
        self.precompiler, self.remat_chosen = self.keeper.precompiler, self.keeper.remat_chosen
        detector = (Unwatched() if config.detector == DETECTOR_OFF else
                    make_detector(config.detector, prober=self.probe, model=model, clock=clock))
        detector.job_checks = multi_process()  # its devices checked from the start
        # asynchronous: a save writes a canonical copy of the state, which no step donates
        # (one process: copied to host beside the next steps; a job: before `save` returns)
        self.checkpointer = (Checkpointer(
            config.checkpoint_dir, interval=config.checkpoint_interval, asynchronous=True,
            identity=programs.identity(data.state()), local_copy_dir=config.local_copy_dir,
            mtbf_s=config.mtbf_s, max_interval_s=config.max_checkpoint_interval_s,
            budget=config.overhead_budget)
            if config.checkpoint_dir else None)
        self.runner = StepRunner(model, config, self.keeper, host, detector, self.checkpointer,
                                 self.sampler, self.spent_s,
                                 NoReplicas() if replicas is None else replicas, clock)
        self.replanner = Replanner(model, config, devices, data, self.keeper, detector,
                                   self.checkpointer, self.staging, clock, on_long_work,
                                   fixed_layout=replicas is not None)
        self.replans = self.replanner.replans
        self._costs_fitted = False

    # ---- the loop ------------------------------------------------------------------------
    def run(self, steps: int, seed: int = 0) -> Iterator[StepRecord | Replan]:
        """Train `steps` steps, yielding each step's record and each re-plan."""
        with responsive_loop():
            yield from self._run(steps, seed)

    def _run(self, steps: int, seed: int) -> Iterator[StepRecord | Replan]:
        if self.state is None:
            self.state = self.program.init_state(seed)
        done = int(self.state.step)
        judging: Judging | None = None  # the last step, judged while the next one runs
        self.runner.replicas.prepare(self.program)
        while done < steps:
            data_before = self.data.state()
            healed = self.runner.replicas.before_step(done + 1, self.state, data_before)
            if healed is not None:  # a peer's state and position, at the quorum's step
                self.state, done, data_before = healed.state, healed.step, healed.data_state
                self.data.restore(data_before)
                judging = None  # the steps it judged are not this replica's any more
                if done >= steps:
                    break
            batch = self.data.next_batch()
            try:
                stepped = self.runner.step(done + 1, batch, beside=judging)
            except StepFailed as failed:
                if multi_process():
                    # the peers are stuck in this step's collectives: no process can go on
                    # in place, so the job restarts on the survivors (see resihp launch)
                    raise JobStepFailed(str(failed)) from failed
                if failed.hung and not failed.verdict.devices:
                    raise StepHung(
                        f"step {failed.verdict.step} of plan {self.plan.describe()} hung: "
                        f"{failed.cause} and no device named{self.runner.untimed_hint()}. A "
                        "collective inside the model's program that some devices never reach, "
                        "or a device that stopped, holds the step's devices, so this process "
                        "cannot go on") from failed
                judging = None  # the failure's re-plan decides now
                yield self.react(failed.verdict, data_before, cause=str(failed))
                continue  # the data iterator was rewound: the same batch runs again
            if stepped is None:  # the replicas did not commit it: the same batch again
                self.data.restore(data_before)
                continue
            record, verdict = stepped
            if not (math.isfinite(record.loss) and math.isfinite(record.grad_norm)):
                raise diverged(record, self.checkpointer)  # that step is never saved
            done = record.step
            self.start_background()  # (after the first step; a no-op after that)
            if not self._costs_fitted and self.detector.cost_params() is not None:
                # the scheduler now plans with measured costs: its picks may change
                self._costs_fitted = True
                self.replanner.prepare_next()
            if self.checkpointer:  # where the cadence says so (every call in the account)
                saving_from = self.clock()
                if self.checkpointer.due(done):  # a save moves the layout
                    self.keeper.await_layouts()
                self.checkpointer.save(done, self.state, self.program, self.data.state())
                self.spent_s["checkpoints"] += self.clock() - saving_from
            judging = Judging(self.detector, self.runner.observation(record))
            yield record
            if self.checkpointer:
                self.checkpointer.stop_if_preempted()
            if verdict is not None:
                judging = None  # that step ran on the plan the verdict just replaced
                yield self.react(verdict, None)
            elif self.replanner.pending_ready():
                judging = None
                self.state, replan = self.replanner.finish_pending(self.state)
                yield replan
            elif self.keeper.timed_ready(primary_says):
                self.keeper.take_timed()
        verdict = self.runner.verdict(judging)  # the last step's: no step to judge it beside
        if verdict is not None:
            yield self.react(verdict, None)
        if self.checkpointer:  # a later run resumes where this one ended
            self.keeper.await_layouts()
            self.checkpointer.save(done, self.state, self.program, self.data.state(),
                                   force=True)
            self.checkpointer.wait()

    # ---- what callers drive --------------------------------------------------------------
    def react(self, verdict: Verdict, data_before: dict[str, Any] | None = None,
              cause: str = "") -> Replan:
        """Update the health map from `verdict`, re-plan, and switch if the plan changes
        (Replanner.react)."""
        self.state, replan = self.replanner.react(verdict, self.state, data_before, cause,
                                                  hint=self.runner.untimed_hint())
        return replan

    def switch_to(self, new: Plan, *, from_checkpoint: bool = False,
                  data_before: dict[str, Any] | None = None) -> Switch:
        """Run `new` from now on, the state moved onto it (Replanner.switch_to)."""
        self.state, switch = self.replanner.switch_to(new, self.state,
                                                      from_checkpoint=from_checkpoint,
                                                      data_before=data_before)
        return switch

    def start_background(self) -> None:
        """Start, once, what the first step does not need (ProgramKeeper.start_background)
        and the likely next plans; `run` calls it after the first step (a warm standby
        before its go, which it waits for anyway)."""
        if not self.keeper.background_started:
            self.keeper.start_background(watching=watches(self.config),
                                         saving=self.checkpointer is not None)
            self.replanner.prepare_next()

    def warm_up(self) -> None:
        """Build now the small programs every step of a job of several processes runs
        besides the step (agreement.py), so the first step compiles none of them."""
        if watches(self.config):
            warm_up_agreement(self.plan)

    def deadline_s(self, batch: GlobalBatch) -> float:
        """How long this batch's step may take before it counts as hung."""
        return self.runner.deadline_s(batch)

    def planning_context(self) -> PlanningContext:
        """What the scheduler plans with now (Replanner.context)."""
        return self.replanner.context()

    def overhead(self, records: Sequence[StepRecord], metrics_s: float | None = None
                 ) -> Overhead:
        """What resilience cost the steps of `records` (this trainer's), see overhead.py;
        `metrics_s`: what writing the run's metrics cost, where they are written."""
        ckpt, spent = self.checkpointer, self.spent_s
        return run_overhead(records, budget=self.config.overhead_budget, metrics_s=metrics_s,
                            checkpoints_s=spent["checkpoints"], detector_s=spent["detector"],
                            probes_s=spent["probes"], timing_s=spent["timing"],
                            counts={"probe_runs": self.probe.runs,
                                    "stage_timed_steps": self.sampler.timed_steps},
                            checkpoint=ckpt.stats.as_dict() if ckpt is not None else None)

    def close(self) -> None:
        self.keeper.close()
        close_replicas = getattr(self.runner.replicas, "close", None)  # (an engine's links)
        if close_replicas is not None:
            close_replicas()

    # ---- what the parts hold -------------------------------------------------------------
    @property
    def state(self) -> TrainState | None:
        """The train state (None before `run` starts one or a caller sets it)."""
        return self.runner.state

    @state.setter
    def state(self, state: TrainState | None) -> None:
        self.runner.state = state

    @property
    def plan(self) -> Plan:
        return self.keeper.plan

    @property
    def program(self) -> StepProgram:
        return self.keeper.program

    @property
    def timed(self) -> bool:
        """Whether the current program times stages (False while an untimed start lasts)."""
        return self.keeper.timed

    @property
    def pending_plan(self) -> Plan | None:
        """The plan the trainer switches to once its program compiled in the background."""
        return self.replanner.pending_plan

    @property
    def health(self) -> Health:
        return self.replanner.health

    @health.setter
    def health(self, health: Health) -> None:
        self.replanner.health = health

    @property
    def detector(self) -> Detector:
        return self.runner.detector

    @detector.setter
    def detector(self, detector: Detector) -> None:
        """Watch with `detector` from now on (every part that asks it)."""
        self.runner.detector = self.replanner.detector = detector

    @property
    def completed(self) -> int | None:
        """The newest step finished on the devices (maybe not yet yielded)."""
        return self.runner.completed

    @property
    def last_prediction_s(self) -> float | None:
        """The healthy time the newest step will be judged against (None: none yet)."""
        return self.runner.last_prediction_s

    @property
    def last_timing(self) -> StepTiming | None:
        """The last step's timing (its stage times None when it ran without the callbacks)."""
        return self.runner.last_timing


@contextlib.contextmanager
def responsive_loop(interval_s: float = SWITCH_INTERVAL_S) -> Iterator[None]:
    """While open, a thread that wants the GIL gets it within `interval_s` (never longer
    than it already would); the previous interval comes back on exit."""
    before = sys.getswitchinterval()
    if before <= interval_s:  # already as short (a nested loop): left alone, not re-rounded
        yield
        return
    sys.setswitchinterval(interval_s)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
