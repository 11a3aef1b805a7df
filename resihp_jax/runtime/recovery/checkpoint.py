"""Orbax checkpoints that restore into any Plan, with the data position beside the weights.

The state is saved in the canonical layout (layers `[n_layers, ...]`), so a checkpoint is
independent of the mesh it was written from. Orbax writes each step to a temporary
directory and renames it when complete, so a crash mid-write leaves the last good
checkpoint as the latest one. Beside the state each step records the run identity, the
leaf shapes and per-leaf checksums, which restore.py checks.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import orbax.checkpoint as ocp

from resihp_jax.errors import CheckpointError, ConfigError, Preempted
from resihp_jax.meshes.agree import from_primary
from resihp_jax.runtime.recovery import local_copies
from resihp_jax.runtime.recovery.cadence import (FIRST_SAVE_S, MAX_INTERVAL_S, Cadence,
                                                 job_mtbf_s)
from resihp_jax.runtime.recovery.checksum import leaf_shapes, state_checksums
from resihp_jax.runtime.recovery.restore import Restored, first_line, restore_from
from resihp_jax.runtime.recovery.run_identity import check_identity
from resihp_jax.step.reshard import to_canonical
from resihp_jax.step.state_io import save_args, state_handler
from resihp_jax.step.program import StepProgram, TrainState


# a step beside an asynchronous write may take this many times the longest write so far
# longer than its own deadline (the write's host work can stall it for that long)
WRITE_MARGIN = 2.0


def deadline_beside_write(ckpt: Checkpointer | None, deadline_s: float,
                          limit_s: float) -> float:
    """The deadline of a step starting now whose own is `deadline_s`, widened while `ckpt`
    writes asynchronously (`Checkpointer.deadline_beside_write`); unchanged without one."""
    return deadline_s if ckpt is None else ckpt.deadline_beside_write(deadline_s, limit_s)


@dataclass
class SaveStats:
    """What this checkpointer's saves cost and did (counted by the library, not timed)."""
    saves: int = 0
    blocking_s: float = 0.0  # the step loop waited this long in `save` calls that saved
    write_s: float = 0.0  # background writes' seconds (each seen to end at a step's start)
    put_off: int = 0  # due saves put off while the previous write was under way
    waits_on_previous_save: int = 0  # cadence saves that waited for the previous write
    urgent_waits: int = 0  # forced or preemption saves that waited for it (as they must)
    saved: list[tuple[int, float, bool]] = dataclasses.field(default_factory=list)
    # ^ each save: (its step, the seconds the loop was blocked, whether forced or preempted)
    # each background write seen to end: (the step saved, the step that saw it end, seconds)
    writes: list[tuple[int, int, float]] = dataclasses.field(default_factory=list)
    announced: bool = False  # the auto cadence was told

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        del out["announced"]
        return out


class Checkpointer:
    """Saves under `directory` at the cadence `interval` (steps, or 'auto': see cadence.py),
    keeping the newest `keep` (docs/api.md lists every argument).

    `mtbf_s` defaults to cadence.GPU_MTBF_S over the job's devices. `handoff` runs the saves
    a one-process run hands off (default: a thread of their own).
    """

    def __init__(self, directory: str | Path, *, interval: int | str = 10, keep: int = 2,
                 asynchronous: bool = False, identity: Mapping[str, Any] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 local_copy_dir: str | Path | None = None, put_off_while_writing: bool = True,
                 mtbf_s: float | None = None, max_interval_s: float = MAX_INTERVAL_S,
                 budget: float | None = None, first_save_s: float = FIRST_SAVE_S,
                 say: Callable[[str], None] | None = None, force_identity: bool = False,
                 handoff: Executor | None = None):
        if keep < 1:
            raise CheckpointError(f"checkpoint keep={keep} must be >= 1")
        try:
            self.cadence = Cadence(interval, mtbf_s=mtbf_s or job_mtbf_s(jax.device_count()),
                                   max_interval_s=max_interval_s, budget=budget,
                                   first_save_s=first_save_s, clock=clock)
        except ConfigError as err:
            raise CheckpointError(str(err)) from err
        self.directory = Path(directory).absolute()
        self.identity = identity
        self.force_identity = force_identity
        self.forced: str | None = None  # what a forced resume found different (said once)
        # the survivors' copies' node-local directory (None: under `directory`)
        self.local_copies = (None if local_copy_dir is None
                             else local_copies.local_root(local_copy_dir, self.directory))
        self._clock = clock
        self.say = say
        self._write_started: float | None = None  # when the asynchronous write under way began
        self._write_step = self._step_now = 0  # the step it saves; the newest step seen
        self._longest_write_s: float | None = None  # of the asynchronous writes seen to end
        self._longest_call_s: float | None = None  # of the `save` calls that saved
        self._put_off = put_off_while_writing
        self._owed = False  # a due save put off while the previous write was under way
        self._preempted = False  # SIGTERM in a one-process run (see preemption.py)
        self._stopping: Preempted | None = None  # its save is written: the run stops
        self.stats = SaveStats()
        # A job's orbax save holds device-collective barriers, which must keep their order
        # among the steps' collectives: only a one-process run hands saves to a thread.
        self._hands_off = asynchronous and jax.process_count() == 1
        self._handing: tuple[int, Future] | None = None  # (step, its save) under way
        self._pool, self._own_pool = handoff, handoff is None
        # orbax decides only preemption saves; the cadence decides the rest (`force`)
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=ocp.checkpoint_managers.PreemptionCheckpointingPolicy(),
            max_to_keep=keep, create=True, enable_async_checkpointing=asynchronous)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": state_handler(), "meta": ocp.JsonCheckpointHandler()})

    def latest_step(self) -> int | None:
        """The newest step saved (a save handed off is waited for until orbax has it)."""
        self._finish_handoff()
        return self._manager.latest_step()

    def _newest(self) -> int | None:
        """The newest step saved or being saved, without waiting for a handed-off save."""
        return self._manager.latest_step() if self._handing is None else self._handing[0]

    def due(self, step: int) -> bool:
        """Whether a save may fall due after `step` (its cadence's, or one put off)."""
        return self._owed or self.cadence.due(step)

    def save(self, step: int, state: TrainState, program: StepProgram,
             data_state: dict[str, Any], force: bool = False) -> bool:
        """Save if `step` is due (or `force`, or a preemption was signalled) and not saved
        yet; returns whether it saved. Call it after every step: the cadence counts them.

        Asynchronous saves first copy the state on its devices (the canonical layout, which
        no step donates), so the caller may donate `state` to the next step. A due save that
        finds the previous write under way is put off (process 0's view decides for a job);
        `force` and a preemption save and wait.
        """
        self.cadence.step_ended(step)
        self._step_now = step
        if self._preempted and step == self._newest():
            self._stop_preempted(step)
            return False
        if self._write_started is not None:
            self.saving()  # (a local look) times the write to the step that sees it end
        if self.cadence.needs_plan():
            self._plan_next(step)
        if step == self._newest():
            return False
        # (the manager's policy saves at JAX's preemption sync point only: asked directly,
        # as `should_save` would, without its per-step look at writes and steps, ~0.2 ms)
        urgent = force or self._preempted or bool(self._manager.reached_preemption(step))
        if not (urgent or self.due(step)):
            return False
        if self._put_off and not urgent and bool(from_primary(self.saving())):
            # The previous write is still under way (saves due faster than the disk takes
            # them: a 3.7 GB state every 10 steps of 43 ms on an H200). Orbax would stall
            # this step until it ends (2.5 s there); save after the first step that finds it
            # done instead.
            self._owed = True
            self.stats.put_off += 1
            return False
        # orbax waits for the write under way before this save (a handed-off one too)
        behind_one = self._handing is not None
        self._finish_handoff()
        if behind_one or self._manager.is_saving_in_progress():
            if urgent:
                self.stats.urgent_waits += 1
            else:
                self.stats.waits_on_previous_save += 1
        started = self._clock()
        canonical = to_canonical(state, program)  # dispatched: a copy of the state's own
        meta = {"step": step, "data_state": data_state, "plan": program.plan.to_dict(),
                "model": program.model.name, "identity": self.identity,
                "leaves": leaf_shapes(canonical)}
        handing = self._hands_off and not urgent and room_beside_steps(canonical)
        if handing:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="resihp-save")
            self._handing = (step, self._pool.submit(self._write, step, canonical, meta))
            saved = True
        else:
            saved = self._write(step, canonical, meta)
        if saved:
            took = self._clock() - started
            self._owed = False
            self._longest_call_s = max(self._longest_call_s or 0.0, took)
            self.stats.saves += 1
            self.stats.blocking_s += took
            self.stats.saved.append((step, took, urgent))
            self.cadence.saved(took)
            self._written()  # orbax ended any earlier write before it began this one
            if handing:  # its copy to host is part of the write, beside the steps
                self._write_started, self._write_step = started, step
            elif self.saving():
                self._write_started, self._write_step = self._clock(), step
        if self._preempted:
            self._stop_preempted(step)
        return saved

    def _write(self, step: int, canonical: TrainState, meta: dict[str, Any]) -> bool:
        """Start orbax's write of `canonical` (its checksums first), returning once the arrays
        are on the host; CheckpointError if it fails."""
        try:
            meta = {**meta, "checksums": state_checksums(canonical)}
            return bool(self._manager.save(step, args=ocp.args.Composite(
                state=save_args(canonical), meta=ocp.args.JsonSave(meta)), force=True))
        except Exception as err:  # orbax raises plain Exceptions; an earlier async write too
            raise CheckpointError(f"saving checkpoint step {step} to {self.directory} "
                                  f"failed: {first_line(err)}") from err

    def _finish_handoff(self) -> None:
        """Wait until a save handed to the thread is with orbax; its error, if it failed."""
        handing, self._handing = self._handing, None
        if handing is not None:
            handing[1].result()  # CheckpointError from `_write`

    def preempt(self) -> None:
        """A preemption was signalled (preemption.py): the next `save` is forced and written
        to the end; the loop then stops (`stop_if_preempted`). Safe in a signal handler."""
        self._preempted = True

    def _stop_preempted(self, step: int) -> None:
        self.wait()
        self._stopping = Preempted(step, str(self.directory))

    def stop_if_preempted(self) -> None:
        """Raise Preempted once a preemption's save is written (the loop calls it after it
        reported the step that save holds)."""
        if self._stopping is not None:
            raise self._stopping

    def _plan_next(self, step: int) -> None:
        """Agree on the step of the next 'auto' save (process 0's proposal); say once which
        interval the measured cost gave."""
        self.cadence.set_next(from_primary(self.cadence.plan_next(step)))
        choice = self.cadence.choice
        if choice is not None and not self.stats.announced:
            self.stats.announced = True
            if self.say is not None:
                steps = self.cadence.next_due - step
                self.say(f"checkpoints: auto cadence {choice.describe()} (about {steps} "
                         "steps at the current step time)")

    def saving(self) -> bool:
        """Whether an asynchronous save is still being written."""
        if self._handing is not None:
            future = self._handing[1]
            if not future.done():
                return True  # (orbax is not asked while the thread is inside it)
            if future.exception() is not None:
                return False  # a look only: the next `save` or `wait` raises its error
            self._finish_handoff()
        under_way = bool(self._manager.is_saving_in_progress())
        if not under_way:
            self._written()
        return under_way

    def wait(self) -> None:
        """Block until pending asynchronous saves are written; CheckpointError if one failed."""
        self._finish_handoff()
        try:
            self._manager.wait_until_finished()
        except Exception as err:  # the error of a background write surfaces here
            raise CheckpointError(f"writing a checkpoint to {self.directory} failed: "
                                  f"{first_line(err)}") from err
        self._written()

    def _written(self) -> None:
        """The write under way, if any, is seen to have ended: time it. Seen, not known: it
        is noticed when asked (at a step's start), so the time is an upper bound."""
        if self._write_started is not None:
            took = self._clock() - self._write_started
            self._longest_write_s = max(self._longest_write_s or 0.0, took)
            self.stats.write_s += took
            self.stats.writes.append((self._write_step, self._step_now, took))
            self.cadence.wrote(took)
            self._write_started = None

    def save_deadline_s(self, floor_s: float, factor: float, limit_s: float) -> float:
        """How long the next `save` call may take before the process counts as hung: `factor`
        times the longest call that saved so far (it holds orbax's barriers, where a frozen
        peer blocks it), at least `floor_s`, widened for a write under way as a step beside
        it is; never past `limit_s` (the start-up deadline), which holds until one is timed.
        """
        if self._longest_call_s is None:
            return limit_s
        own = min(limit_s, max(floor_s, factor * self._longest_call_s))
        return min(limit_s, self.deadline_beside_write(own, limit_s))

    def deadline_beside_write(self, deadline_s: float, limit_s: float) -> float:
        """The deadline of a step starting now whose own is `deadline_s`: while a write is
        under way (it competes for the host), WRITE_MARGIN times the longest write timed so
        far on top, never past `limit_s`, and `limit_s` until a write is timed. A hang during
        a write is thus caught about as soon as one between writes.
        """
        if not self.saving():
            return deadline_s
        if self._longest_write_s is None:
            return max(deadline_s, limit_s)
        return max(deadline_s, min(limit_s, deadline_s + WRITE_MARGIN * self._longest_write_s))

    def restore(self, program: StepProgram, step: int | None = None) -> Restored:
        """The checkpoint at `step` (default: the newest good one, see restore.py) placed
        into `program`'s plan; an explicit `step` that is damaged raises CheckpointError."""
        self._finish_handoff()
        return restore_from(self._manager, self.directory, program, step, self.check_identity)

    def check_identity(self, saved: Mapping[str, Any] | None, where: str) -> None:
        """Refuse state `saved` by another run (see run_identity.py); a forced resume
        continues and says so once."""
        if self.identity is None:
            return
        forced = check_identity(saved, self.identity, where, force=self.force_identity)
        if forced is not None and self.forced is None:
            self.forced = forced
            if self.say is not None:
                self.say(forced)

    def reload(self) -> None:
        """Read the directory's list of steps again: a standby built its checkpointer long
        before the job wrote its newest steps."""
        self._finish_handoff()
        self._manager.reload()

    def close(self) -> None:
        try:
            self._finish_handoff()
        finally:
            if self._pool is not None and self._own_pool:
                self._pool.shutdown()
            self._manager.close()


def room_beside_steps(copy: Any, stats_of: Callable[[Any], Mapping[str, int] | None]
                      = lambda device: device.memory_stats()) -> bool:
    """Whether every device holding `copy` has room for it beside a step: a handed-off copy
    stays on the devices while the next steps run, on top of their peak (the devices' own
    `peak_bytes_in_use`), where a save on the loop freed it before the next step. Devices
    without memory statistics (CPUs: their memory is the host's) always have room."""
    need: dict[Any, int] = {}
    for leaf in jax.tree.leaves(copy):
        for shard in leaf.addressable_shards:
            need[shard.device] = need.get(shard.device, 0) + shard.data.nbytes
    for device, nbytes in need.items():
        stats = stats_of(device)
        if stats and "bytes_limit" in stats and \
                stats.get("peak_bytes_in_use", 0) + nbytes > stats["bytes_limit"]:
            return False
    return True
