"""The steps of one training process: the one loop of `resihp train` (with `--adapt` or
without), `rh.fit` and the demo, the ResilientTrainer's, under whatever it is asked to watch:
start-up (restore or initialize, the survivors' copies, SIGTERM's save), the loop's events
handed to its listeners (listeners.py), and what it trained (`RunResult`). A failed or hung
step cannot be survived in place by a job of several processes: the process exits for a
relaunch on the survivors.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, TextIO

from resihp_jax.errors import HostsLeftOut
from resihp_jax.plan import Plan
from resihp_jax.runtime.job.deadline import Ladder
from resihp_jax.runtime.job.heartbeat import Heartbeat
from resihp_jax.runtime.recovery.copy_writers import node_of_host
from resihp_jax.runtime.recovery.host_copies import HostCopies, activate, deactivate
from resihp_jax.runtime.recovery.preemption import SaveOnSigterm
from resihp_jax.runtime.programs.deferred import compile_layouts
from resihp_jax.runtime.events import Replan, StepRecord
from resihp_jax.runtime.trainer.overhead import Overhead
from resihp_jax.runtime.trainer.resilient import ResilientTrainer
from resihp_jax.runtime.recovery.resume import start_state
from resihp_jax.runtime.config import RESUME_FORCE, RunConfig
from resihp_jax.runtime.run.model_identity import with_current_hyperparams
from resihp_jax.runtime.run.listeners import (Callback, Heartbeats, KeepCopies, Listener,
                                              ReplanReport)
from resihp_jax.runtime.run.record_sink import RecordSink
from resihp_jax.runtime.run.run_metrics import optimizer_learning_rate


@dataclass(frozen=True)
class RunResult:
    """What a run trained: each step's record, the re-plans, the plan of the last step, what
    resilience cost, and the final state (on the devices) with the program that reads it."""
    records: list[StepRecord]
    replans: list[Replan]
    plan: Plan
    overhead: Overhead | None
    state: Any
    program: Any

    def canonical_params(self) -> Any:
        """The trained parameters in the model's canonical order, fetched to the host (in a
        job a collective: every process calls it)."""
        import jax  # noqa: PLC0415

        return jax.device_get(self.program.canonical_params(self.state))


class ProcessRun:
    def __init__(self, config: RunConfig, copies: str | None, job: Any, model: Any,
                 train_cfg: Any, plan: Plan, data: Any, ladder: Ladder,
                 phases: dict[str, float], out: TextIO, *, programs: Any = None,
                 on_step: Callable[[StepRecord], None] | None = None,
                 compiles_from: float | None = None, devices: Any = None,
                 fault_hook: Any = None, listeners: Sequence[Listener] = (),
                 replicas: Any = None) -> None:
        """`compiles_from`: see RecordSink. `devices`: those a one-process run may use and
        re-plan onto (default: every device; where given, background compiles prepare plans
        on those alone)."""
        import jax  # noqa: PLC0415

        self.config, self.job, self.data, self.out, self.phases = config, job, data, out, phases
        self.ladder, self.on_step, self.copies = ladder, on_step, copies
        self.model, self.train_cfg, self.programs = model, train_cfg, programs
        self.compiles_from = compiles_from
        self.result: RunResult | None = None  # once trained
        self.listeners = list(listeners)  # besides the run's own (see `_listeners`)
        self.beats = Heartbeats(Heartbeat.from_env(job.spec.host_id), ladder, config.steps,
                                phases)
        self.report = ReplanReport(job, config.checkpoint_dir, out)
        t0 = time.perf_counter()
        devices = list(devices) if devices is not None else jax.devices()
        # the run's resilience settings as the user gave them (rh.fit, the flags): the
        # trainer reads each where it is, and the ladder was built from the same ones
        self.trainer = ResilientTrainer(model, train_cfg, plan, devices, data,
                                        config.resilience, fault_hook=fault_hook,
                                        on_long_work=lambda what: self.beats.long_work(
                                            self.trainer.plan), programs=programs,
                                        replicas=replicas)
        if replicas is not None:  # a replica waiting on its peers' quorum is not hung
            replicas.on_wait = lambda waiting: self.beats.waiting(waiting, self.trainer.plan)
        self.trainer.warm_up()
        self.report.say_remat(self.trainer, None)
        if self.trainer.checkpointer is not None:  # a resume forced on purpose
            self.trainer.checkpointer.force_identity = self.config.resume == RESUME_FORCE
        if self.trainer.checkpointer is not None and job.primary:  # the cadence it chose
            self.trainer.checkpointer.say = lambda line: print(line, file=out, flush=True)
        phases["compile_s"] = time.perf_counter() - t0
        self.kept = host_copies(copies, job, self.trainer.checkpointer)
        # one process without survivors' copies: SIGTERM saves the step under way and ends
        # the run (preemption.py); where copies are kept, they answer SIGTERM instead
        ckpt = self.trainer.checkpointer
        self.sigterm = (SaveOnSigterm(ckpt) if ckpt is not None and self.kept is None
                        and jax.process_count() == 1 else None)

    def prepare_all(self) -> None:
        """Compile now what the trainer would compile after its first step (a warm standby,
        before its go: a relaunch's restore moves the layout on its critical path)."""
        compile_layouts(self.trainer.program)
        self.trainer.start_background()

    def attach(self, job: Any, compiles_from: float) -> None:
        """Train in `job` from now on: the heartbeat and host copies under its host id, the
        checkpoint list read afresh. A standby built its run (and compiled it) for
        placeholder hosts long before its go named the real ones."""
        self.job, ckpt = job, self.trainer.checkpointer
        if self.beats.heartbeat is not None:
            self.beats.heartbeat.close()  # it wrote nothing: told a step once training starts
        close_host_copies(self.kept)
        if ckpt is not None:
            ckpt.reload()
        self.beats.heartbeat = Heartbeat.from_env(job.spec.host_id)
        self.report.job = job
        self.kept = host_copies(self.copies, job, ckpt)
        self.compiles_from = compiles_from

    def run(self) -> list[StepRecord]:
        start = self._initial_state()
        self.beats.beat(start, self.ladder.startup_s, self.trainer.plan)
        if start >= self.config.steps:
            print(f"step {start} already reaches --steps {self.config.steps}: nothing to train",
                  file=self.out)
            trainer = self.trainer
            self.result = RunResult([], [], trainer.plan, None, trainer.state, trainer.program)
            return []
        return self._steps(start)

    def close(self) -> None:
        try:
            self.trainer.close()
            if self.trainer.checkpointer is not None:
                self.trainer.checkpointer.wait()
                self.trainer.checkpointer.close()
        finally:
            if self.beats.heartbeat is not None:
                self.beats.heartbeat.close()
            # last: a save that cannot finish (a peer died mid-write) leaves SIGTERM to the
            # copies' handler, which names the failure and exits 75, not to a silent death
            close_host_copies(self.kept)
            if self.sigterm is not None:
                self.sigterm.close()

    def _initial_state(self) -> int:
        t0 = time.perf_counter()
        trainer = self.trainer
        start = start_state(trainer.program, trainer.checkpointer, self.data,
                            resume=bool(self.config.resume), seed=self.config.seed,
                            primary=self.job.primary, out=self.out)
        if trainer.checkpointer is not None and trainer.checkpointer.forced is not None:
            # a resume forced past a changed optimizer trains with its hyper-parameters
            start = dataclasses.replace(start, state=with_current_hyperparams(
                start.state, trainer.program.optimizer))
        trainer.state = start.state
        self.phases["restore_s"] = time.perf_counter() - t0
        if self.beats.heartbeat is not None:
            self.beats.heartbeat.source = start.source
        self.start_record = start.record
        if self.kept is not None:  # a failure in the first step loses nothing either
            self.kept.capture(start.step, start.state, trainer.program, self.data.state(),
                                   start.record)
        return start.step

    def _listeners(self, sink: RecordSink) -> list[Listener]:
        """Who hears each event, in order: the copies first (before the next step donates
        the state; the record then says what the copy cost), the records and metrics, the
        caller's own, the re-plan report, the heartbeat last (its deadline is the next
        step's, once everything this step does is done)."""
        copies = [KeepCopies(self.kept, self.data)] if self.kept is not None else []
        user = [Callback(self.on_step)] if self.on_step is not None else []
        return [*copies, sink, *user, *self.listeners, self.report, self.beats]

    def _steps(self, start: int) -> list[StepRecord]:
        sink = RecordSink(self.config, start, self.job.primary, self.phases, self.start_record,
                          self.compiles_from, self.out, model=self.model,
                          learning_rate=optimizer_learning_rate)
        trainer, listeners = self.trainer, self._listeners(sink)
        try:
            for event in self._on_error(trainer.run(self.config.steps, seed=self.config.seed)):
                for listener in listeners:
                    if isinstance(event, Replan):
                        listener.replan(event, trainer)
                    else:
                        event = listener.step(event, trainer) or event
        finally:
            for listener in listeners:
                listener.close(trainer)
            # what writing the metrics cost (None: none are written)
            metrics_s = sink.metrics.metrics.seconds if sink.metrics is not None else None
            overhead = trainer.overhead(sink.records, metrics_s=metrics_s)
        self.result = RunResult(sink.records, list(trainer.replans), trainer.plan,
                                overhead, trainer.state, trainer.program)
        return sink.records

    def _on_error(self, events: Iterator[Any]) -> Iterator[Any]:
        """`events`. When a re-plan leaves slow processes out, their hosts go into the health
        record as excluded before the error ends this process. On any error (or a close),
        even one from that record, the step finished on the devices but never yielded (a
        peer died during the collectives that follow it: this process stopped a step behind
        peers that got further) is kept too, so the copies of that step are whole."""
        try:
            try:
                yield from events
            except HostsLeftOut as out:
                if self.config.checkpoint_dir is not None:
                    self.job.record_exclusion(out.processes, f"slow: {out.reason}", out.step,
                                              self.config.checkpoint_dir)
                raise
        except BaseException:
            if self.kept is not None:
                keep_completed(self.kept, self.trainer)
            raise


def keep_completed(kept: Any, trainer: Any) -> bool:
    """Keep in `kept` the trainer's state when it is a step finished on the devices that
    is newer than the newest kept; whether it did. Such a step failed in what follows it on
    the host, before the next batch was drawn: the data position is the one after it. A
    state a failed step donated, or one still being computed, is left alone."""
    import jax  # noqa: PLC0415

    completed, state = trainer.completed, trainer.state
    newest = kept.newest_step
    if completed is None or state is None or (newest is not None and completed <= newest):
        return False
    try:
        leaves = jax.tree.leaves(state)
        # is_deleted first: is_ready on a deleted buffer crashes the process (JAX 0.10.2)
        if any(leaf.is_deleted() for leaf in leaves) or not all(
                leaf.is_ready() for leaf in leaves):
            return False
        if int(jax.device_get(state.step)) != completed:
            return False
    except Exception:  # noqa: BLE001 - deleted (donated) buffers: nothing to keep
        return False
    kept.capture(completed, state, trainer.program, trainer.data.state(), None)
    return True


def host_copies(mode: str | None, job: Any, ckpt: Any) -> HostCopies | None:
    """This process's copies of the last completed step (None without a checkpoint directory
    or with copies off), written out by the process's exit paths and on SIGTERM."""
    if ckpt is None or mode is None:
        return None
    hosts = tuple(getattr(job, "hosts", ()))  # each process's host id, in process order
    node_of = (lambda process: node_of_host(hosts[process])) if hosts else None
    kept = HostCopies(ckpt.directory, job.spec.host_id, ckpt.identity, mode=mode,
                              node_of=node_of, local_root=getattr(ckpt, "local_copies", None))
    activate(kept)
    kept.exit_on_sigterm()
    return kept


def close_host_copies(kept: HostCopies | None) -> None:
    if kept is not None:
        deactivate(kept)
        kept.close()
