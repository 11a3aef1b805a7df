"""The steps of one training process without re-planning: restore or initialize, compile,
train, and while doing so keep the job's supervisor informed (heartbeat) and never hang
(watchdog).

Every process of a job runs this same loop; only process 0 writes the metrics
(run_metrics.py) and draws the progress bar. The phases of start-up (join, plan, restore,
compile, first step) are measured and published with the heartbeat, so a supervisor can
split a recovery into its parts.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from typing import Any, TextIO

from resihp_jax.meshes.plan import Plan
from resihp_jax.metrics.writers import metrics_file  # noqa: F401 - the JSON lines file's home
from resihp_jax.runtime.job.deadline import Ladder, StepDeadline
from resihp_jax.runtime.job.heartbeat import Heartbeat
from resihp_jax.runtime.recovery.copy_writers import node_of_host
from resihp_jax.runtime.recovery.host_snapshot import HostSnapshots, activate, deactivate
from resihp_jax.runtime.recovery.preemption import SaveOnSigterm
from resihp_jax.runtime.trainer.compiles import foreground_hits_since, foreground_since
from resihp_jax.runtime.trainer.deferred import BackgroundCompiles, compile_layouts, compile_step
from resihp_jax.runtime.trainer.gil import responsive_loop
from resihp_jax.runtime.trainer.loop import StepRecord, train
from resihp_jax.runtime.trainer.overhead import OVERHEAD_BUDGET, run_overhead
from resihp_jax.runtime.recovery.resume import start_state
from resihp_jax.runtime.run.config import RunConfig
from resihp_jax.runtime.run.run_metrics import RunMetrics
from resihp_jax.runtime.job.watchdog import Watchdog
from resihp_jax.runtime.recovery.checkpoint import deadline_beside_write
from resihp_jax.step.builder import build_step


class TrainRun:
    def __init__(self, config: RunConfig, copies: str | None, job: Any, model: Any,
                 train_cfg: Any, plan: Plan, data: Any, ckpt: Any, ladder: Ladder,
                 phases: dict[str, float], out: TextIO,
                 compiles_from: float | None = None, programs: Any = None) -> None:
        """`copies`: how the survivors' copies are kept (None: none; see host_snapshot.py).
        `compiles_from`: when its start-up's critical path began (see RecordSink).
        `programs`: the model's step builder (runtime/run/programs.py); default: `build_step`
        of the ModelConfig `model`."""
        self.config, self.job, self.plan, self.data, self.ckpt = config, job, plan, data, ckpt
        self.out, self.phases, self.copies = out, phases, copies
        self.compiles_from = compiles_from
        self.model, self.train_cfg = model, train_cfg
        # compiled before the first step, so that step times the step alone and gives the
        # next one a deadline (a hang just after a relaunch is caught as fast as any)
        self.deadline = StepDeadline(model, ladder, remat=train_cfg.remat,
                                     first_compiles=False)
        self.heartbeat = Heartbeat.from_env(job.spec.host_id)
        self.watchdog = Watchdog()
        import jax  # noqa: PLC0415

        t0 = time.perf_counter()
        # the step alone: the layout moves only a checkpoint save (or a restore) runs
        build = programs or functools.partial(build_step, model)
        self.program = compile_step(build(train_cfg, plan, jax.devices()))
        phases["compile_s"] = time.perf_counter() - t0
        self.snapshots = host_copies(copies, job, ckpt)
        self.sigterm = save_on_sigterm(ckpt, self.snapshots)
        self.overhead = None  # what resilience cost, once trained (overhead.py)
        self._background = BackgroundCompiles()

    def prepare_all(self) -> None:
        """Compile now what the run would compile after its first step (a warm standby,
        before its go: a relaunch's restore moves the layout on its critical path)."""
        compile_layouts(self.program)

    def attach(self, job: Any, compiles_from: float) -> None:
        """Train in `job` (a standby's, once its go named its hosts; see attach_job)."""
        self.heartbeat, self.snapshots = attach_job(self, job, self.ckpt)
        self.compiles_from = compiles_from

    def run(self) -> list[StepRecord]:
        state, start = self._initial_state()
        if self.snapshots is not None:  # a failure in the first step loses nothing either
            self.snapshots.capture(start, state, self.program, self.data.state(),
                                   self.start_record)
        self._beat(start, self.deadline.ladder.startup_s)
        if start >= self.config.steps:
            print(f"step {start} already reaches --steps {self.config.steps}: nothing to train",
                  file=self.out)
            return []
        return self._steps(state, start)

    def close(self) -> None:
        self.watchdog.close()
        self._background.close()
        try:
            if self.ckpt is not None:
                self.ckpt.wait()  # a pending save completes (or reports its failure) first
                self.ckpt.close()
        finally:
            if self.heartbeat is not None:
                self.heartbeat.close()
            close_host_copies(self.snapshots)  # last, as AdaptRun.close says why
            if self.sigterm is not None:
                self.sigterm.close()

    def _initial_state(self) -> tuple[Any, int]:
        """(state, step) to train from: see resume.start_state."""
        t0 = time.perf_counter()
        try:
            start = start_state(self.program, self.ckpt, self.data,
                                resume=bool(self.config.resume), seed=self.config.seed,
                                primary=self.job.primary, out=self.out)
        finally:
            self.phases["restore_s"] = time.perf_counter() - t0
        if self.heartbeat is not None:
            self.heartbeat.source = start.source
        self.start_record = start.record
        return start.state, start.step

    def _beat(self, step: int, deadline_s: float) -> None:
        if self.heartbeat is not None:
            self.heartbeat.update(step, deadline_s, self.plan.describe(), self.phases)

    def _before_step(self, plan: Plan, batch: Any) -> None:
        step = self.data_step + 1
        deadline = self.deadline.deadline_s(plan, batch.sum_sq_lengths())
        # a checkpoint being written competes with this step for the host (several times
        # slower on a loaded one): the step gets the write's length on top
        deadline = deadline_beside_write(self.ckpt, deadline, self.deadline.ladder.startup_s)
        self.watchdog.arm(step, deadline)
        self._beat(self.data_step, deadline)

    def _after_step(self, state: Any, record: StepRecord) -> StepRecord:
        """The step is done: keep its state for the survivors' copies (before the next step
        may donate it), write its record, and only then tell the supervisor (a fault it
        injects at this step must find both); a checkpoint save gets its own deadline."""
        self.watchdog.arm(record.step, self.deadline.ladder.startup_s, "the survivors' copy")
        if self.snapshots is not None:
            record = dataclasses.replace(record, host_copy_s=self.snapshots.capture(
                record.step, state, self.program, self.data.state(), record.to_json()))
        self.sink.add(record, state=state, checkpointer=self.ckpt)
        self._layouts_for_saves(record.step)
        self.deadline.observe(self.plan, record.sum_sq_lengths, record.step_time_s)
        save_s = self._save_deadline_s(record.step)
        self.watchdog.arm(record.step, save_s, "the checkpoint save")
        self._beat(record.step, save_s)
        return record

    def _layouts_for_saves(self, step: int) -> None:
        """A save moves the state to the canonical layout: that program compiles in the
        background from the first step on, and is waited for when a save is due."""
        if self.ckpt is None:
            return
        self._background.start(lambda: compile_layouts(self.program, ("to_canonical_fn",)))
        if self.ckpt.due(step) or step >= self.config.steps:
            self._background.wait()

    def _save_deadline_s(self, step: int) -> float:
        """The deadline of the save after `step`: learned from the saves before it (a peer
        frozen at this step blocks it in orbax's barriers), except after the last step,
        whose forced save and final write the start-up deadline covers."""
        ladder = self.deadline.ladder
        if self.ckpt is None or step >= self.config.steps:
            return ladder.startup_s
        return self.ckpt.save_deadline_s(ladder.floor_s, ladder.factor, ladder.startup_s)

    def _steps(self, state: Any, start: int) -> list[StepRecord]:
        train_cfg = self.train_cfg
        self.sink = RecordSink(self.config, start, self.job.primary, self.phases,
                               self.start_record, self.compiles_from, self.out,
                               model=self.model,
                               learning_rate=lambda step, _: train_cfg.learning_rate_at(step))
        self.data_step = start
        try:
            with responsive_loop():  # background threads hold the step loop up briefly
                for _, record in train(self.program, state, self.data,
                                       self.config.steps - start, self.ckpt,
                                       before_step=self._before_step,
                                       after_step=self._after_step):
                    self.watchdog.disarm()
                    self.data_step = record.step
        finally:
            self.watchdog.disarm()
            ckpt = self.ckpt
            self.sink.close(ckpt)
            # no detector, probes or stage timing here: the saves' blocking and the copies
            self.overhead = run_overhead(
                self.sink.records, budget=OVERHEAD_BUDGET,
                checkpoints_s=sum(s for _, s, urgent in ckpt.stats.saved if not urgent)
                if ckpt is not None else 0.0,  # (the final save comes after the last step)
                checkpoint=ckpt.stats.as_dict() if ckpt is not None else None,
                metrics_s=self.sink.metrics_s)
        return self.sink.records


def host_copies(mode: str | None, job: Any, ckpt: Any) -> HostSnapshots | None:
    """This process's copies of the last completed step (None without a checkpoint directory
    or with copies off), written out by the process's exit paths and on SIGTERM."""
    if ckpt is None or mode is None:
        return None
    hosts = tuple(getattr(job, "hosts", ()))  # each process's host id, in process order
    node_of = (lambda process: node_of_host(hosts[process])) if hosts else None
    snapshots = HostSnapshots(ckpt.directory, job.spec.host_id, ckpt.identity, mode=mode,
                              node_of=node_of, local_root=getattr(ckpt, "local_copies", None))
    activate(snapshots)
    snapshots.exit_on_sigterm()
    return snapshots


def save_on_sigterm(ckpt: Any, snapshots: HostSnapshots | None) -> SaveOnSigterm | None:
    """A one-process run without survivors' copies: SIGTERM saves the step under way and
    ends the run (preemption.py). Where copies are kept, they answer SIGTERM instead."""
    import jax  # noqa: PLC0415

    if ckpt is None or snapshots is not None or jax.process_count() > 1:
        return None
    return SaveOnSigterm(ckpt)


def close_host_copies(snapshots: HostSnapshots | None) -> None:
    if snapshots is not None:
        deactivate(snapshots)
        snapshots.close()


def attach_job(run: Any, job: Any, ckpt: Any) -> tuple[Heartbeat | None, HostSnapshots | None]:
    """`run` (a TrainRun or AdaptRun) trains in `job` from now on: its heartbeat and host
    copies under `job`'s host id, its checkpoint list read afresh. A standby built its run
    (and compiled it) for placeholder hosts long before its go named the real ones."""
    run.job = job
    if run.heartbeat is not None:
        run.heartbeat.close()  # it wrote nothing: it is told a step only once training starts
    close_host_copies(run.snapshots)
    if ckpt is not None:
        ckpt.reload()
    return Heartbeat.from_env(job.spec.host_id), host_copies(run.copies, job, ckpt)


class RecordSink:
    """Where finished steps go: the records, process 0's metrics (run_metrics.py) and progress
    bar, and the first step's time among the start-up phases."""

    def __init__(self, config: RunConfig, start: int, primary: bool,
                 phases: dict[str, float], start_record: dict | None = None,
                 compiles_from: float | None = None,
                 out: TextIO | None = None, *, model: Any = None,
                 learning_rate: Any = None) -> None:
        """`start_record`: the record of step `start` if known (the survivors' copies carry
        it), written when a JSON lines file lacks it. `compiles_from`: when the start-up's
        critical path began (time.time()): the first step then says how many executables
        were built on it (compiles.foreground_since). `model`, `learning_rate`: the model's
        facts (for MFU) and the learning rate of a step (run_metrics.py)."""
        from tqdm import tqdm  # noqa: PLC0415

        self.phases, self.compiles_from, self.out = phases, compiles_from, out
        self.records: list[StepRecord] = []
        self.bar = tqdm(total=config.steps, initial=start, unit="step", file=sys.stderr,
                        disable=not config.progress or not primary)
        # a resumed run continues the metrics of the run it resumes, from its checkpoint:
        # records of steps after it (lost with the failed incarnation) are dropped
        self.metrics = (RunMetrics.open(config, start, start_record, model=model,
                                        learning_rate=learning_rate, say=self._say)
                        if config.metrics and primary else None)

    def _say(self, line: str) -> None:
        print(line, file=self.out or sys.stdout, flush=True)

    def add(self, record: StepRecord, **observed: Any) -> None:
        """`observed`: what the metrics add to the record (RunMetrics.step's keywords)."""
        if not self.records:
            self.phases["first_step_s"] = record.step_time_s
            self._count_compiles()
        self.records.append(record)
        if self.metrics is not None:
            self.metrics.step(record, **observed)
        self.bar.set_postfix(loss=f"{record.loss:.4f}", tok_s=f"{record.tokens_per_s:,.0f}")
        self.bar.update()

    @property
    def metrics_s(self) -> float | None:
        """What writing the metrics cost (None: none are written)."""
        return self.metrics.seconds if self.metrics is not None else None

    def _count_compiles(self) -> None:
        if self.compiles_from is None:
            return
        built, seconds = foreground_since(self.compiles_from)
        loaded = min(foreground_hits_since(self.compiles_from), built)
        self.phases.update(compiles=float(built), compiles_s=seconds, cache_loads=float(loaded))
        if self.out is None:
            return
        if loaded:
            print(f"start-up: {built - loaded} executable(s) compiled and {loaded} loaded from "
                  f"the compile cache ({seconds:.2f} s) on the way to the first step",
                  file=self.out, flush=True)
        else:
            print(f"start-up: {built} executable(s) compiled ({seconds:.2f} s) on the way to "
                  "the first step" + (": every program was ready" if built == 0 else ""),
                  file=self.out, flush=True)

    def close(self, checkpointer: Any = None, state: Any = None) -> None:
        """`checkpointer`, `state`: for the metrics' events of the saves after the last step."""
        self.bar.close()
        if self.metrics is not None:
            self.metrics.close(checkpointer, state)
