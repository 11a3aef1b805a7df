"""ResilientTrainer: train, watch every step, and re-plan around slow or stopped devices.

Each step: take the next global batch, run it (guarded by a timeout), hand its timing and
its exact batch to the detector. A verdict updates the health map; the scheduler proposes a
plan; if it differs, the state moves onto it (in memory, or from the latest checkpoint when
a device stopped and a checkpoint exists) and training continues from the same data
position. A step that failed is re-run on the new plan with the same batch, so no data is
skipped or repeated.

Switches are as cheap as the new plan allows (see `Replan.kind`): a new split of the same
mesh reuses the compiled program; a new mesh whose program the background `Precompiler`
prepared (the scheduler's picks for any one device slow or dead) compiles nothing; only an
unforeseen mesh compiles, and after a fail-slow verdict not on the spot
(`ResilienceConfig.background_compile`): the scheduler's interim plan (the best split the
current program runs) trains while the new mesh's program compiles in the background, and
the trainer switches to it at the first step boundary after it is ready. A device that
stopped cannot wait: its re-plan compiles on the spot. The scheduler is charged these
measured costs.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np

from resihp_jax.data import BatchIterator, GlobalBatch
from resihp_jax.detector import (Prober, StepFailed, StepObservation, Verdict, make_detector,
                                 run_guarded)
from resihp_jax.detector.attention_work import mb_attention_l2
from resihp_jax.detector.probes import gathered_probe
from resihp_jax.errors import (ConfigError, HostsLeftOut, JobStepFailed, PlanError,
                               ResihpError, StepHung)
from resihp_jax.meshes import layout
from resihp_jax.plan import Plan
from resihp_jax.perfmodel.costs import REMAT_AUTO
from resihp_jax.perfmodel.memory import (DEFAULT_DEVICE_MEMORY_GB, compiled_bytes,
                                         devices_memory_gb, remat_for_memory)
from resihp_jax.perfmodel import CostParams, Health
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.meshes.agree import (bytes_from_primary, from_payload, from_primary,
                                     max_over_processes, multi_process, primary_payload)
from resihp_jax.runtime.recovery.checkpoint import Checkpointer, deadline_beside_write
from resihp_jax.runtime.trainer.compile_cache import enable_compilation_cache
from resihp_jax.runtime.trainer.compiles import counting
from resihp_jax.runtime.trainer.deferred import (MOVES, await_started, compile_layouts,
                                                 compile_step)
from resihp_jax.runtime.trainer.gil import responsive_loop
from resihp_jax.runtime.trainer.unwatched import Unwatched
from resihp_jax.step.instrument import FaultHook
from resihp_jax.runtime.trainer.records import device_batch, diverged
from resihp_jax.runtime.events import StepRecord
from resihp_jax.runtime.trainer.precompile import Precompiler
from resihp_jax.runtime.trainer.remat_choice import within_memory
from resihp_jax.step.staging import HostStaging
from resihp_jax.step.warmup import warm_up
from resihp_jax.runtime.recovery.run_identity import identity_of
from resihp_jax.runtime.trainer.host_cpu import CpuMeter
from resihp_jax.runtime.trainer.judging import Judging
from resihp_jax.runtime.trainer.overhead import Overhead, run_overhead
from resihp_jax.runtime.trainer.sampling import TimingSampler
from resihp_jax.runtime.trainer.timing import StageTimer, StepTiming, timed_step
from resihp_jax.scheduler import PlanningContext, SwitchCosts, run_policy
from resihp_jax.scheduler.scoring import step_time_s
from resihp_jax.step.aot import compile_program
from resihp_jax.step.config import StepConfig
from resihp_jax.step.instrument import OFF, Instrument
from resihp_jax.step.reshard import move_state, move_via_orbax, same_devices
from resihp_jax.step.program import StepProgram, TrainState
from resihp_jax.step.builder import build_step
from resihp_jax.runtime.config import DETECTOR_OFF, ResilienceConfig
from resihp_jax.runtime.events import Replan, Switch

LIKELY_SLOWDOWNS = (2.0, 4.0)  # the fail-slow factors the precompiler plans for


class _Host:
    """The one Instrument host every program of this trainer calls: it forwards to the
    current plan's fault hook and stage timer, so programs compiled ahead of time need no
    rebuild when the plan they serve becomes current."""

    def __init__(self) -> None:
        self.hook: FaultHook | None = None
        self.timer: StageTimer | None = None

    def __call__(self, *event: Any) -> None:
        if self.hook is not None:
            self.hook(*event)  # first: its injected delay belongs in the timed region
        if self.timer is not None:
            self.timer(*event)


@dataclass
class ResilientTrainer:
    """Trains `plan` on `devices`, watching every step; `run(n)` yields StepRecords and Replans.

    `model`: a ModelConfig (its step: `build_step`, `rh.models.Llama` from it), or the facts
    of a user's model (perfmodel/facts.py) with `programs` building its step for each plan."""
    model: ModelFacts
    train_cfg: StepConfig
    plan: Plan
    devices: Sequence[jax.Device]
    data: BatchIterator
    config: ResilienceConfig = field(default_factory=ResilienceConfig)
    fault_hook: FaultHook | None = None  # tests, benchmarks and the demo inject faults here
    clock: Callable[[], float] = time.perf_counter
    # told before work between steps that may take long (a probe, a switch), so a
    # supervisor watching for progress can allow for it
    on_long_work: Callable[[str], None] | None = None
    # (train_cfg, plan, devices, instrument) -> the StepProgram of a user's model; None:
    # `build_step`'s of the ModelConfig `model`. Either is the one step builder's program.
    # Its `identity(data_state)`, where it has one, is the run's identity its checkpoints
    # record (rh.fit's: the user's model and optimizer, runtime/run/model_identity.py).
    programs: Callable[..., StepProgram] | None = None

    def __post_init__(self) -> None:
        self._cache_dir = enable_compilation_cache(self.config.compile_cache_dir)
        self.health = Health.healthy()
        self._host = _Host()
        self._instrument = Instrument(self._host)
        self._compile_s: float | None = None  # measured cost of a mesh compiled on the spot
        self._warm_s = 0.0  # measured cost of taking a prepared program
        # the first step runs the untimed program (from the cache when the job ran this plan
        # before) when there is a cache and no fault is injected (faults act through the
        # stage-timing callbacks)
        wanted = self.config.untimed_start
        wanted = multi_process() if wanted is None else wanted
        untimed = bool(self._cache_dir and wanted and self.fault_hook is None)
        if self.fault_hook is not None and not self.config.stage_timing:
            raise ConfigError("a fault_hook acts through the stage-timing callbacks: "
                              "ResilienceConfig(stage_timing=True)")
        timed = self.config.stage_timing and not untimed
        self._untimed_wanted = bool(wanted)
        # remat="auto": each mesh's policy and why (written by whichever thread compiles it)
        self.remat_chosen: dict[tuple, tuple[str, str]] = {}
        # the memory of a device every process fits its steps and plans into, agreed now
        self._memory_gb = self._agreed_memory_gb()
        # the step alone: the layout moves and every background compile wait for the first
        # step (`start_background`), so nothing competes with it for the host's cores
        self._install(self._compiled(self.plan, timed=timed, layouts=False), self.plan,
                      timed=timed)
        self.detector = (Unwatched() if self.config.detector == DETECTOR_OFF else
                         make_detector(self.config.detector, prober=self._probe,
                                       model=self.model, clock=self.clock))
        self.detector.job_checks = multi_process()  # its devices checked from the start
        # asynchronous: a save writes a canonical copy of the state, which no step donates
        # (one process: copied to host beside the next steps; a job: before `save` returns)
        self.checkpointer = (Checkpointer(
            self.config.checkpoint_dir, interval=self.config.checkpoint_interval,
            asynchronous=True,
            identity=identity_of(self.programs, self.model, self.train_cfg, self.data.state()),
            local_copy_dir=self.config.local_copy_dir, mtbf_s=self.config.mtbf_s,
            max_interval_s=self.config.max_checkpoint_interval_s,
            budget=self.config.overhead_budget)
            if self.config.checkpoint_dir else None)
        # host memory for a move onto a prepared mesh, touched while it is prepared (one
        # process only: a job of several moves through orbax)
        self.staging = HostStaging(budget_bytes=0 if multi_process() else None)
        self._warmed: set[int] = set()  # ids of the step executables run once ahead
        self.precompiler = Precompiler(self._compiled, stage=self._stage_prepared)
        self._untimed_cached: set[tuple] = set() if timed else {self.plan.mesh_key()}
        self._layouts: Future[None] | None = None  # the first program's moves, compiling
        self._background_started = False
        self.state: TrainState | None = None
        # the newest step finished on the devices (maybe not yet yielded)
        self.completed: int | None = None
        self.replans: list[Replan] = []
        # a switch waiting for its program to compile in the background: the plan, and the
        # verdict and reason that chose it
        self._pending: tuple[Plan, Verdict, str] | None = None
        self._costs_fitted = False
        # what resilience spent on the step loop's path (see overhead.py): saves (every
        # call, put-off checks included), probe runs, stage timing (the timers' own time)
        self.spent_s = {"checkpoints": 0.0, "detector": 0.0, "probes": 0.0, "timing": 0.0}
        self.probe_runs = 0
        self.sampler = TimingSampler(self.config.stage_timing_every,
                                     self.config.overhead_budget)
        self._step_timed = True  # whether the last step ran its stage-timing callbacks
        # the healthy time the newest step will be judged against (None: none yet), worked
        # out beside that step: its judgement comes a step later
        self.last_prediction_s: float | None = None
        self._last_l2_M = np.zeros(0)  # the newest step's attention work per micro-batch

    def _agreed_memory_gb(self) -> float:
        """GiB a device has for a step: `config.device_memory_gb`, else the least this
        process's devices report (0: none does, as CPU devices); in a job the least over its
        processes, so that each picks the same remat policy and plans for a figure (one
        collective, here, where every process builds its first program)."""
        own = self.config.device_memory_gb or devices_memory_gb(
            [d for d in self.devices if d.process_index == jax.process_index()], default_gb=0.0)
        return float(-max_over_processes(np.array([-own]))[0])

    # ---- programs ------------------------------------------------------------------------
    def _compiled(self, plan: Plan, timed: bool | None = None,
                  layouts: bool = True) -> StepProgram:
        """`plan`'s program, built and compiled now (any thread); `timed`: with the stage
        timing (and fault) callbacks, else without (the persistent cache can hold it;
        default: `config.stage_timing`); `layouts`: its layout moves too, else they compile
        on first use (deferred.py)."""
        timed = self.config.stage_timing if timed is None else timed
        slots = max(self.train_cfg.microbatch_slots or layout.default_microbatch_slots(
            plan.n_microbatches, plan.dp), max(plan.microbatches_per_group))
        train_cfg = self.train_cfg.replace(microbatch_slots=slots)
        # One device: its stage timing compares it with no other stage (and no probe is
        # built), while on a GPU each host callback stalls the step: no callbacks there,
        # unless a fault hook injects through them
        instrument = (self._instrument if timed and (plan.n_devices > 1
                                                     or self.fault_hook is not None) else None)

        def build(cfg: StepConfig) -> StepProgram:
            if self.programs is not None:
                return self.programs(cfg, plan, self.devices, instrument)
            return build_step(self.model, cfg, plan, self.devices, instrument=instrument)

        if train_cfg.remat == REMAT_AUTO:
            program = self._within_memory(plan, train_cfg, build)
        else:
            program = compile_step(build(train_cfg))
        return compile_program(program) if layouts else program

    def _within_memory(self, plan: Plan, train_cfg: StepConfig,
                       build: Callable[[StepConfig], StepProgram]) -> StepProgram:
        """`plan`'s step compiled under `remat="auto"`'s policy for it (remat_choice.py): the
        memory model's choice, stepped up while XLA says the compiled step does not fit."""
        first = remat_for_memory(self.model, plan, self._memory_gb or DEFAULT_DEVICE_MEMORY_GB)
        program, policy, why = within_memory(
            lambda policy, last: compile_step(build(train_cfg.replace(remat=policy)),
                                              warn_over_memory=last),
            first, self._memory_gb * 2**30 if self._memory_gb else None,
            lambda program: compiled_bytes(program.step_fn))
        self.remat_chosen[plan.mesh_key()] = (policy, why)  # any thread: one key, one write
        return program

    def start_background(self) -> None:
        """Start what the first step does not need, in the background thread: the current
        program's layout moves, the stage-timed step of an untimed start, the untimed step
        for the compile cache, the likely next plans. Once; `run` calls it after the first
        step (a warm standby before its go, which it waits for anyway)."""
        if self._background_started:
            return
        self._background_started = True
        program, moves = self.program, self._moves_ahead()
        if self.config.background_compile and moves:
            self._layouts = self.precompiler.run_later(lambda: compile_layouts(program, moves))
        if self._untimed_start():  # the stage-timed step, for a step boundary once compiled
            self.precompiler.prepare([self.plan])
        self._cache_untimed()
        self._prepare_next()

    def _moves_ahead(self) -> tuple[str, ...]:
        """The layout moves worth compiling ahead: all of them where a detector may call for
        a re-plan; with nothing watched only a save's, where saves are made (a failed step's
        re-plan compiles its moves when it comes: four processes on two cores compiling
        every move beside the first steps slowed them threefold)."""
        if self._watching:
            return MOVES
        return ("to_canonical_fn",) if self.checkpointer is not None else ()

    def _cache_untimed(self) -> None:
        """Compile the current plan's untimed program once, in the background, so that JAX
        writes it to the persistent cache: a later start on this plan (a relaunch onto the
        same plan, a spare in the failed node's place) then loads it."""
        key = self.plan.mesh_key()
        if self._cache_dir and self._untimed_wanted and key not in self._untimed_cached:
            self._untimed_cached.add(key)
            plan = self.plan
            self.precompiler.run_later(lambda: self._compiled(plan, timed=False))

    @property
    def timed(self) -> bool:
        """Whether the current program times stages (False while an untimed start lasts)."""
        return self._timed

    def _timed_ready(self) -> bool:
        """The untimed start may end: the stage-timed program is compiled (on process 0,
        which decides for all: every process must run the same program in a step)."""
        if not self._untimed_start():
            return False
        if not self.precompiler.has(self.plan):  # cancelled for a switch's program: again
            self.precompiler.prepare([self.plan])
        return _primary_says(self.plan.mesh_key() in self.precompiler.ready())

    def _untimed_start(self) -> bool:
        """An untimed start lasts: the current program is untimed, and a timed one is wanted."""
        return not self._timed and self.config.stage_timing

    def _take_timed(self) -> None:
        """Run the stage-timed program from the next step on: same plan, same shardings, so
        the state stays where it is."""
        program = self.precompiler.take(self.plan) or self._compiled(self.plan)
        self._install(program, self.plan)

    def _stage_prepared(self, program: StepProgram) -> None:
        """In the background: touch the host buffers a move onto `program`'s mesh fills, and
        (with `warm_prepared`) run the program once."""
        if self.staging.budget_bytes:
            self.staging.reserve(program.abstract_state())
        if self.config.warm_prepared and not multi_process() and \
                id(program.step_fn) not in self._warmed:
            warm_up(program)
            self._warmed.add(id(program.step_fn))

    def _install(self, program: StepProgram, plan: Plan, timed: bool = True) -> None:
        self.program, self.plan, self._timed = program, plan, timed
        self._host.hook = self.fault_hook.with_plan(plan) if self.fault_hook else None
        self._host.timer = StageTimer((plan.dp, plan.pp, plan.tp), cpu=CpuMeter())
        self._prober: Prober | None = None  # compiled at the first alarm on this plan

    def _program_for(self, plan: Plan) -> tuple[StepProgram, str]:
        """The program to run `plan` with, and how it was had."""
        if self.program.accepts(plan):
            return self.program.with_plan(plan), "split_only"
        prepared = self.precompiler.take(plan)
        if prepared is not None:
            return prepared, "mesh_warm"
        return self._compiled(plan), "mesh_cold"

    def _prepare_next(self) -> None:
        if self.config.precompile > 0:
            # a snapshot: the background thread must not see a switch half-way
            args = (self.program, self.health, self._context())
            self.precompiler.prepare_later(lambda: self.likely_next_plans(*args))

    def likely_next_plans(self, program: StepProgram, health: Health,
                          context: PlanningContext) -> list[Plan]:
        """The scheduler's picks for any one more device slow, then any one dead, that need a
        program other than `program`: at most `config.precompile` of them. Slow devices come
        first: a fail-slow is handled in place, while on a real cluster a dead device takes
        its process down and the job restarts anyway."""
        out: dict[tuple, Plan] = {}
        ids = program.plan.device_ids
        faults = [health.with_changes(compute={d: 1 / f}) for f in LIKELY_SLOWDOWNS
                  for d in ids] + [health.with_changes(dead=(d,)) for d in ids]
        for what in faults:
            plan = run_policy(self.config.policy, program.plan, what, context).plan
            if plan is not None and not program.accepts(plan):
                out.setdefault(plan.mesh_key(), plan)
            if len(out) >= self.config.precompile:
                break
        return list(out.values())

    # ---- the loop ----------------------------------------------------------------------
    def run(self, steps: int, seed: int = 0) -> Iterator[StepRecord | Replan]:
        """Train `steps` steps, yielding each step's record and each re-plan; meanwhile a
        background thread's Python cannot hold the step loop up for long (gil.py)."""
        with responsive_loop():
            yield from self._run(steps, seed)

    def _run(self, steps: int, seed: int) -> Iterator[StepRecord | Replan]:
        if self.state is None:
            self.state = self.program.init_state(seed)
        done = int(self.state.step)
        # the last step, judged while the devices run the next one (judging.py)
        judging: Judging | None = None
        while done < steps:
            data_before = self.data.state()
            batch = self.data.next_batch()
            try:
                record, verdict = self._step(done + 1, batch, beside=judging)
            except StepFailed as failed:
                if multi_process():
                    # the peers are stuck in this step's collectives: no process can go on
                    # in place, so the job restarts on the survivors (see resihp launch)
                    raise JobStepFailed(str(failed)) from failed
                if failed.hung and not failed.verdict.devices:
                    raise StepHung(self._hung_line(failed)) from failed
                judging = None  # the failure's re-plan decides now
                yield self.react(failed.verdict, data_before, cause=str(failed))
                continue  # the data iterator was rewound: the same batch runs again
            if not (math.isfinite(record.loss) and math.isfinite(record.grad_norm)):
                raise diverged(record, self.checkpointer)  # that step is never saved
            done = record.step
            self.start_background()  # (after the first step; a no-op after that)
            if not self._costs_fitted and self.detector.cost_params() is not None:
                # the scheduler now plans with measured costs: its picks may change
                self._costs_fitted = True
                self._prepare_next()
            if self.checkpointer:
                saving_from = self.clock()
                if self.checkpointer.due(done):  # a save moves the layout
                    await_started(self._layouts)
                self.checkpointer.save(done, self.state, self.program, self.data.state())
                self.spent_s["checkpoints"] += self.clock() - saving_from
            judging = Judging(self.detector, self._observation(record))
            yield record
            if self.checkpointer:
                self.checkpointer.stop_if_preempted()
            if verdict is not None:
                judging = None  # that step ran on the plan the verdict just replaced
                yield self.react(verdict, None)
            elif self._pending_ready():
                judging = None
                yield self._finish_pending()
            elif self._timed_ready():
                self._take_timed()
        verdict = self._verdict(judging)  # the last step's: no step to judge it beside
        if verdict is not None:
            yield self.react(verdict, None)
        if self.checkpointer:  # a later run resumes where this one ended
            await_started(self._layouts)
            self.checkpointer.save(done, self.state, self.program, self.data.state(),
                                   force=True)
            self.checkpointer.wait()

    def _verdict(self, judging: Judging | None, agree: bool = True) -> Verdict | None:
        """`judging`'s verdict, the same on every process (this process's own, not `agree`d:
        the caller agrees on it); the time the step loop waited for it (a judgement not made
        beside a step, the probes excluded) is the detector's."""
        if judging is None:
            return None
        judging_from, probes_before = self.clock(), self.spent_s["probes"]
        # nothing watched: no verdict on any process, nothing to agree on (a collective
        # a step less: on gloo a tenth of a second)
        verdict = judging.verdict()
        if agree and self._watching:
            verdict = _agreed(verdict)
        self.spent_s["detector"] += (self.clock() - judging_from
                                     - (self.spent_s["probes"] - probes_before))
        return verdict

    def close(self) -> None:
        self.precompiler.close()

    def overhead(self, records: Sequence[StepRecord], metrics_s: float | None = None
                 ) -> Overhead:
        """What resilience cost the steps of `records` (this trainer's), see overhead.py;
        `metrics_s`: what writing the run's metrics cost, where they are written."""
        ckpt = self.checkpointer
        return run_overhead(records, budget=self.config.overhead_budget, metrics_s=metrics_s,
                            checkpoints_s=self.spent_s["checkpoints"],
                            detector_s=self.spent_s["detector"],
                            probes_s=self.spent_s["probes"], timing_s=self.spent_s["timing"],
                            counts={"probe_runs": self.probe_runs,
                                    "stage_timed_steps": self.sampler.timed_steps},
                            checkpoint=ckpt.stats.as_dict() if ckpt is not None else None)

    def warm_up(self) -> None:
        """Build now the small programs every step of a job of several processes runs
        besides the step (gathering its timings, process 0's broadcast of the verdict), so
        the first step compiles nothing: a relaunch's first step is on its critical path."""
        if multi_process() and self._watching:
            _agreed_step(StepTiming(0.0, np.zeros((self.plan.dp, self.plan.pp, self.plan.tp))),
                         None)
            from_primary(None)  # (the last step's verdict, the checkpoints' decisions)

    @property
    def _watching(self) -> bool:
        """Does a detector watch the steps (the same on every process)? Off, each process
        times its own steps for its own deadlines, and no verdict needs agreeing."""
        return self.config.detector != DETECTOR_OFF

    def _knobs(self, step: int, timed: bool = True) -> np.ndarray | None:
        """The hook's per-device knobs for this step (None: healthy); it may raise a stop.
        Not `timed`: every device the hook does not slow is `OFF` (no callbacks)."""
        knobs = self._host.hook.knobs(step) if self._host.hook is not None else None
        if timed:
            return knobs
        grid = np.ones((self.plan.dp, self.plan.pp, self.plan.tp), np.float32) \
            if knobs is None else np.asarray(knobs, np.float32)
        return np.where(grid > 1.0, grid, np.float32(OFF))

    @property
    def last_timing(self) -> StepTiming:
        """The last step's timing (its stage times None when it ran without the callbacks)."""
        return self._last_timing

    def _instrumented(self) -> bool:
        """Does the current program carry the stage-timing callbacks (see `_compiled`)?"""
        return (self._timed and self.config.stage_timing
                and (self.plan.n_devices > 1 or self.fault_hook is not None))

    def _probe(self, step: int):  # noqa: ANN202 - a ProbeResult
        if self.on_long_work is not None:
            self.on_long_work("probe")
        started = self.clock()
        if self._prober is None:  # (its compile is a one-off, not a run's cost)
            self._prober = Prober(self.plan, self.devices, host=self._host.hook)
            started = self.clock()
        result = self._prober.run(self._knobs(step))
        result = gathered_probe(result, self.plan.device_ids) if multi_process() else result
        self.spent_s["probes"] += self.clock() - started
        self.probe_runs += 1
        return result

    def _step(self, step: int, batch: GlobalBatch, beside: Judging | None = None
              ) -> tuple[StepRecord, Verdict | None]:
        """Run one step to completion; `beside`: the previous step's judgement, made while
        the devices run this one, whose verdict (agreed by every process) comes back with
        the step's record."""
        program, timer = self.program, self._host.timer
        arrays = device_batch(program, batch)
        instrumented = self._instrumented()
        in_doubt = self.detector.wants_stage_times()
        timed = instrumented and self.sampler.wants(in_doubt)
        self._step_timed = timed

        dispatched = threading.Event()

        def run_once() -> tuple[TrainState, dict[str, Any], Any]:
            try:
                return timed_step(program, self.state, arrays, self._knobs(step, timed),
                                  timer, dispatched)
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
            self.last_prediction_s = self.detector.prediction_s(self.plan, self._mb_tokens(),
                                                                l2_M[0])
            return self.deadline_s(batch, l2_M[0])

        spent_before = timer.spent_s
        self.state, metrics, timing = run_guarded(run_once, step, deadline,
                                                  in_flight=self._in_flight)
        self.spent_s["timing"] += timer.spent_s - spent_before
        # done on the devices: should a later collective of this step fail (a peer died
        # meanwhile), this process can still keep it, as peers that got further did
        self.completed = step
        # the previous step's verdict: its probes, if any, use the devices this step has left
        verdict = self._verdict(beside, agree=False)
        if multi_process() and self._watching:  # every detector sees the same observation
            timing, verdict = _agreed_step(timing, verdict)
        if instrumented:
            self.sampler.observe(timed, timing.step_time_s, timer.spent_s - spent_before,
                                 in_doubt=in_doubt)
        self._last_timing = timing
        self._last_l2_M = l2_M[0]
        return StepRecord.of(int(self.state.step), self.plan, jax.device_get(metrics),
                             timing.step_time_s, batch), verdict

    def deadline_s(self, batch: GlobalBatch, l2_M: np.ndarray | None = None) -> float:
        """How long this batch's step may take before it counts as hung (worked out while
        the devices run the step: not on the step loop's path, nor in its account).
        `l2_M`: the batch's attention work per micro-batch, when already known."""
        l2_M = mb_attention_l2(self.model, batch) if l2_M is None else l2_M
        predicted = self.detector.healthy_time_s(self.plan, self._mb_tokens(), l2_M)
        if predicted is None:
            return self.config.step_timeout_s
        deadline = max(self.config.hang_floor_s, self.config.hang_factor * predicted)
        # an asynchronous write under way may hold the host: the step gets its length too
        return deadline_beside_write(self.checkpointer, deadline, self.config.step_timeout_s)

    def _mb_tokens(self) -> np.ndarray:
        return np.full(self.plan.n_microbatches, self.plan.microbatch_size * self.plan.seq_len,
                       np.float64)

    def _in_flight(self) -> tuple[int, ...]:
        grid = self.plan.device_grid()
        return tuple(int(grid[c]) for c in self._host.timer.in_flight())

    def _observation(self, record: StepRecord) -> StepObservation:
        """The step just run, as the detector judges it."""
        return StepObservation(record.step, self.plan, self._mb_tokens(), self._last_l2_M,
                               record.step_time_s, self._last_timing.stage_DxP,
                               self._last_timing.host_cpu)

    # ---- reacting to a verdict -------------------------------------------------------------
    def _untimed_hint(self) -> str:
        """Why a failed step named no device, where the cause is that it ran untimed ('' where
        it ran timed): said both by a hang and by a re-plan that cannot avoid the failure."""
        return ("; it ran without stage timing, which names a device that hangs "
                "(ResilienceConfig(stage_timing_every=1) times every step)"
                if not self._step_timed and self._instrumented() else "")

    def _hung_line(self, failed: StepFailed) -> str:
        """What a one-process run says when a step hung without naming a device."""
        return (f"step {failed.verdict.step} of plan {self.plan.describe()} hung: "
                f"{failed.cause} and no device named{self._untimed_hint()}. A collective "
                "inside the model's program that some devices never reach, or a device that "
                "stopped, holds the step's devices, so this process cannot go on")

    def react(self, verdict: Verdict, data_before: dict[str, Any] | None = None,
              cause: str = "") -> Replan:
        """Update the health map from `verdict`, re-plan, and switch if the plan changes.
        `data_before`: the data position to rewind to (the failed step's batch re-runs).
        PlanError when a step failed and no plan avoids the cause (re-running it would
        fail the same way forever)."""
        if verdict.kind == "stopped" and not verdict.devices:
            raise PlanError(f"step {verdict.step} failed without naming a device, so no plan "
                            f"can avoid it: {cause or 'no cause given'}{self._untimed_hint()}")
        start = self.clock()
        self._pending = None  # this verdict's plan supersedes one still compiling
        self.health = _updated_health(self.health, verdict)
        outcome = run_policy(self.config.policy, self.plan, self.health, self._context())
        plan_s = self.clock() - start
        old = self.plan
        new = outcome.plan if outcome.plan is not None else old
        # train an interim plan while `new` compiles in the background, when it must compile
        interim = outcome.interim if not self._ready_for(new) else None
        if multi_process():  # process 0 decides: its plans are every process's plans
            new, interim = _primary_plans(new, interim)
        if verdict.kind == "stopped" and set(verdict.devices) & set(new.device_ids):
            raise PlanError(f"device(s) {list(verdict.devices)} stopped at step {verdict.step} "
                            f"and no plan without them exists: {outcome.reason}")
        # a process the new plan leaves without devices must leave the job (it could take no
        # part in the move through orbax: a process without shards of a leaf cannot restore
        # it); only the hosts of the named devices are excluded from it, the others come
        # back at the relaunch (also when no named host is left out)
        left_out = set(_processes_left_out(self.devices, new)) \
            - set(_processes_left_out(self.devices, old)) if multi_process() else set()
        named = {d.process_index for d in self.devices if int(d.id) in verdict.devices}
        if left_out:
            raise HostsLeftOut(tuple(sorted(left_out & named)), verdict.step,
                               f"devices {list(verdict.devices)} {verdict.kind} "
                               f"x{verdict.slowdown:.2f}; plan {new.describe()}")
        reason = outcome.reason
        if interim is not None and not left_out:  # a process leaving cannot wait for it
            self.precompiler.prepare_first(new)
            self._pending = (new, verdict, reason)
            new, reason = interim, f"{reason}; training {interim.describe()} meanwhile"
        fields: dict[str, Any] = {}
        if new != old:
            fields = dataclasses.asdict(self.switch_to(
                new, from_checkpoint=verdict.kind == "stopped", data_before=data_before))
        elif data_before is not None:
            self.data.restore(data_before)
        return self._replanned(Replan(verdict.step, verdict, old, new, reason,
                                      self.clock() - start, plan_s=plan_s, cause=cause,
                                      predicted_gain=self._predicted_gain(old, new), **fields))

    def _replanned(self, replan: Replan) -> Replan:
        """Record a re-plan; the detector measures its drift scale afresh on the new plan."""
        self.detector.rebaseline()
        self.replans.append(replan)
        return replan

    @property
    def pending_plan(self) -> Plan | None:
        """The plan the trainer switches to once its program compiled in the background."""
        return None if self._pending is None else self._pending[0]

    def _ready_for(self, plan: Plan) -> bool:
        """Can `plan` run without compiling on this thread (its program reused or ready)?"""
        return self.program.accepts(plan) or plan.mesh_key() in self.precompiler.ready()

    def _pending_ready(self) -> bool:
        """A switch waits and its program is ready (on process 0, which decides for all)."""
        if self._pending is None:
            return False
        return _primary_says(self._pending[0].mesh_key() in self.precompiler.ready())

    def _finish_pending(self) -> Replan:
        """Switch to the plan whose program compiled in the background."""
        assert self._pending is not None
        new, verdict, reason = self._pending
        self._pending = None
        start, old = self.clock(), self.plan
        fields = dataclasses.asdict(self.switch_to(new))
        return self._replanned(Replan(int(self.state.step), verdict, old, new,
                                      f"{reason}; its program compiled in the background",
                                      self.clock() - start,
                                      predicted_gain=self._predicted_gain(old, new), **fields))

    def _predicted_gain(self, old: Plan, new: Plan) -> float | None:
        """The simulated step time of `old` over `new`'s under the current health map (what
        the re-plan is expected to win; a report, decided on nothing)."""
        if new == old:
            return None
        try:
            context = self._context()
            before, after = step_time_s(old, self.health, context), \
                step_time_s(new, self.health, context)
        except (ResihpError, ValueError):
            return None
        return before / after if 0 < after and math.isfinite(before) else None

    def switch_to(self, new: Plan, *, from_checkpoint: bool = False,
                  data_before: dict[str, Any] | None = None) -> Switch:
        """Run `new` from now on: its program (reused, prepared or compiled now) and the state
        moved onto it, or restored from the newest checkpoint when `from_checkpoint` and one
        exists (the data position then comes from the checkpoint, else `data_before`)."""
        if self.on_long_work is not None:
            self.on_long_work("switch")
        await_started(self._layouts)  # a new split runs the current program's restage
        with counting() as count:
            t0 = self.clock()
            program, kind = self._program_for(new)
            t1 = self.clock()
            restored = None
            if from_checkpoint and self.checkpointer and \
                    self.checkpointer.latest_step() is not None:
                got = self.checkpointer.restore(program)
                state, restored = got.state, got.step
                self.data.restore(got.data_state)
            else:
                state = self._move(program)
                if data_before is not None:
                    self.data.restore(data_before)
            self.state = jax.block_until_ready(state)
            t2 = self.clock()
        if kind == "mesh_cold":
            self._compile_s = t1 - t0
        elif kind == "mesh_warm":
            self._warm_s = t1 - t0
        if kind != "split_only" and self._timed:  # (an untimed one waits for its timed one)
            self.precompiler.keep(self.program)  # going back later compiles nothing
        # a new split of the untimed program stays untimed until the timed one takes over
        self._install(program, new,
                      timed=(self._timed or kind != "split_only") and self.config.stage_timing)
        self.staging.clear()  # reserved for the plans likely after the old one
        self._cache_untimed()
        self._prepare_next()
        return Switch(kind, t1 - t0, t2 - t1, count.compiles, restored)

    def _move(self, program: StepProgram) -> TrainState:
        """The state moved onto `program`: in memory, or through orbax when the mesh
        changes in a job of several processes (one jitted program cannot span two device
        sets, and JAX cannot move arrays between them across processes)."""
        if multi_process() and not same_devices(self.program, program):
            if self.config.checkpoint_dir is None:
                raise ConfigError("a job of several processes moves state onto a new mesh "
                                  "through orbax: give it a checkpoint directory")
            return move_via_orbax(self.state, self.program, program,
                                  Path(self.config.checkpoint_dir) / "reshard")
        return move_state(self.state, self.program, program, self.staging)

    def _context(self) -> PlanningContext:
        costs = self.detector.cost_params()
        ready = self.precompiler.ready()
        measured = self._compile_s if self._compile_s is not None else self.config.recompile_s
        switch = SwitchCosts(recompile_s=measured, warm_s=self._warm_s, prepared=ready,
                             layer_slots=self.program.layer_slots,
                             microbatch_slots=self.program.mb_slots,
                             horizon_s=self.config.horizon_s,
                             background=self.config.background_compile)
        return PlanningContext(
            self.model, costs or CostParams.for_model(self.model),
            (self._memory_gb or DEFAULT_DEVICE_MEMORY_GB) * 2**30,
            tuple(int(d.id) for d in self.devices),
            # remat="auto": the running step's policy, as its cost and memory were measured
            schedule="gpipe", remat=self.program.train.remat, switch=switch)


def _primary_plans(new: Plan, interim: Plan | None) -> tuple[Plan, Plan | None]:
    """Process 0's plan and interim plan on every process."""
    got = from_primary({"plan": new.to_dict(),
                        "interim": None if interim is None else interim.to_dict()})
    return Plan.from_dict(got["plan"]), (None if got["interim"] is None
                                         else Plan.from_dict(got["interim"]))


def _processes_left_out(devices: Sequence[jax.Device], plan: Plan) -> tuple[int, ...]:
    """Processes of the job that hold no device of `plan`."""
    used = set(plan.device_ids)
    every = {d.process_index for d in devices}
    kept = {d.process_index for d in devices if int(d.id) in used}
    return tuple(sorted(every - kept))


def _primary_says(ready: bool) -> bool:
    """Process 0's `ready` on every process (it decides for all: every process must run the
    same program in a step)."""
    return bool(from_primary(ready or None)) if multi_process() else ready


def _agreed(verdict: Verdict | None) -> Verdict | None:
    """Process 0's verdict on every process (identical inputs give identical verdicts, but a
    split decision must be impossible, not merely unlikely)."""
    if not multi_process():
        return verdict
    return _verdict_of(from_primary(None if verdict is None else dataclasses.asdict(verdict)))


def _agreed_step(timing: StepTiming, verdict: Verdict | None
                 ) -> tuple[StepTiming, Verdict | None]:
    """The step's timing as the whole job saw it and process 0's `verdict` on the step
    before, in one all-gather: the size of process 0's verdict rides along with the timing
    (the other processes send 0), and only a step with a verdict (rare) broadcasts its bytes.
    One collective a step where two were (each a host round-trip; on gloo 0.1 s)."""
    payload = primary_payload(None if verdict is None else dataclasses.asdict(verdict))
    timing, (size,) = timing.gathered_with((float(len(payload)),))
    return timing, _verdict_of(from_payload(bytes_from_primary(payload, int(size))))


def _verdict_of(fields: dict[str, Any] | None) -> Verdict | None:
    return None if fields is None else Verdict(**{**fields, "devices": tuple(fields["devices"])})


def _updated_health(health: Health, verdict: Verdict) -> Health:
    if verdict.kind == "stopped":
        return health.with_changes(dead=verdict.devices)
    update = {d: 1.0 / max(verdict.slowdown, 1.0) for d in verdict.devices}
    if verdict.kind == "link":
        return health.with_changes(link=update)
    return health.with_changes(compute=update)
