"""What a run does with the loop's events, one listener per job: the survivors' copies, the
heartbeat that tells the supervisor each step's deadline, the re-plan report, the user's
`on_step`; records and metrics are `RecordSink`'s (record_sink.py), the demo's display its own.
The run (process.py) hands each event to every listener in turn, with the trainer for what
the event does not carry; a listener may return a changed record, which the ones after it see.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, TextIO

if TYPE_CHECKING:  # (the demo's command line imports this before JAX may start)
    from resihp_jax.runtime.events import Replan, StepRecord
    from resihp_jax.runtime.job.deadline import Ladder


class Listener:
    """Told every event of a run's loop (each method a no-op unless overridden)."""

    def step(self, record: StepRecord, trainer: Any) -> StepRecord | None:
        """A step finished: its record (return a changed one, or None to pass it on)."""
        return None

    def replan(self, replan: Replan, trainer: Any) -> None:
        """The trainer reacted to a verdict (re-planned, or kept its plan)."""

    def close(self, trainer: Any) -> None:
        """The loop ended (also on an error): after its last event."""


class Callback(Listener):
    """The user's `on_step(record)` after every step."""

    def __init__(self, on_step: Callable[[StepRecord], None]) -> None:
        self.on_step = on_step

    def step(self, record: StepRecord, trainer: Any) -> None:
        self.on_step(record)


class KeepCopies(Listener):
    """Each finished step's state copied for the survivors (recovery/host_copies.py), before
    the next step donates it; the record says what the copy cost."""

    def __init__(self, kept: Any, data: Any) -> None:
        self.kept, self.data = kept, data

    def step(self, record: StepRecord, trainer: Any) -> StepRecord:
        seconds = self.kept.capture(record.step, trainer.state, trainer.program,
                                    self.data.state(), record.to_json())
        return dataclasses.replace(record, host_copy_s=seconds)


def next_deadline_s(ladder: Ladder, steps: int, done: int, predicted_s: float | None,
                    checkpointer: Any) -> float:
    """How long the step after step `done` may take before the supervisor calls it hung."""
    if done >= steps:
        # the final checkpoint and the job's shutdown follow, guarded by no step deadline
        return float(ladder.init_timeout_s)
    deadline = ladder.deadline_s(predicted_s)
    if checkpointer is not None and checkpointer.due(done + 1):
        # the trainer saves that step before it reports it: the save's own deadline on top
        # (a slowed or loaded peer holds every process in orbax's barriers; two runs of a
        # throttled 4-process job were called hung at a save step without it)
        deadline += checkpointer.save_deadline_s(ladder.floor_s, ladder.factor,
                                                 ladder.startup_s)
    from resihp_jax.runtime.recovery.checkpoint import deadline_beside_write  # noqa: PLC0415

    # an asynchronous write under way may hold the host: the step gets its length too
    return deadline_beside_write(checkpointer, deadline, ladder.startup_s)


class Heartbeats(Listener):
    """The heartbeat's step (None outside a launched job) and the deadline of the step in
    flight: after each step the next one's, after a re-plan and during long work the start-up
    time (the next step may compile); the start-up's `phases` go with every beat."""

    def __init__(self, heartbeat: Any, ladder: Ladder, steps: int,
                 phases: dict[str, float]) -> None:
        self.heartbeat, self.ladder, self.steps, self.phases = heartbeat, ladder, steps, phases
        self.done = 0  # the newest step told
        self.deadline_s = 0.0  # the step in flight's, as last told
        self._waiting_from = 0.0  # when a wait on the replicas' quorum was said

    def beat(self, step: int, deadline_s: float, plan: Any, waiting: bool = False) -> None:
        self.done, self.deadline_s = step, deadline_s
        if self.heartbeat is not None:
            self.heartbeat.update(step, deadline_s, plan.describe(), self.phases, waiting)

    def long_work(self, plan: Any) -> None:
        """A probe or a switch (it may compile) is under way: allow it the start-up time."""
        self.beat(self.done, self.ladder.startup_s, plan)

    def waiting(self, waiting: bool, plan: Any) -> None:
        """A replica waits on its peers' quorum (`waiting`: the start-up time allowed, as a
        replica waiting for a majority to return is not hung), or no longer: the step's own
        deadline again, plus the time waited (the launcher counts from the step's start)."""
        if waiting:
            self._waiting_from, deadline_s = time.monotonic(), self.deadline_s
            self.beat(self.done, self.ladder.startup_s, plan, waiting=True)
            self.deadline_s = deadline_s
        else:
            self.beat(self.done, self.deadline_s + time.monotonic() - self._waiting_from, plan)

    def step(self, record: StepRecord, trainer: Any) -> None:
        self.beat(record.step, next_deadline_s(self.ladder, self.steps, record.step,
                                               trainer.last_prediction_s,
                                               trainer.checkpointer), trainer.plan)

    def replan(self, replan: Replan, trainer: Any) -> None:
        self.beat(replan.step, self.ladder.startup_s, trainer.plan)


class ReplanReport(Listener):
    """Each re-plan in one line on process 0's output (and what `remat="auto"` chose for a new
    mesh); a slow device's verdict in the job's health record, so a relaunch plans around it
    too."""

    def __init__(self, job: Any, checkpoint_dir: str | None, out: TextIO) -> None:
        self.job, self.checkpoint_dir, self.out = job, checkpoint_dir, out

    def replan(self, replan: Replan, trainer: Any) -> None:
        verdict = replan.verdict
        if verdict.kind in ("compute", "link") and self.checkpoint_dir is not None:
            self.job.record_slowdown(verdict.devices, verdict.slowdown, self.checkpoint_dir)
        what = (f"devices {list(verdict.devices)} {verdict.kind} x{verdict.slowdown:.2f}"
                if verdict.kind != "stopped" else f"devices {list(verdict.devices)} stopped")
        if replan.new_plan == replan.old_plan:
            print(f"step {replan.step}: {what}; plan kept ({replan.reason})", file=self.out)
            return
        print(f"step {replan.step}: {what}; re-planned to {replan.new_plan.describe()} "
              f"({replan.kind}: plan {replan.plan_s:.2f} s, compile {replan.compile_s:.2f} s, "
              f"move {replan.move_s:.2f} s)", file=self.out, flush=True)
        self.say_remat(trainer, replan.old_plan)

    def say_remat(self, trainer: Any, before: Any) -> None:
        """What `remat="auto"` chose for the current plan's mesh and why, where it differs
        from its choice for the plan `before` (None: the first plan)."""
        chosen = trainer.remat_chosen
        now = chosen.get(trainer.plan.mesh_key())
        was = chosen.get(before.mesh_key()) if before is not None else None
        if now is not None and self.job.primary and (was is None or was[0] != now[0]):
            print(f"remat: {now[0]} ({now[1]})", file=self.out, flush=True)
