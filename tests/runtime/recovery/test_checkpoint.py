"""Checkpoints restore into any plan (also onto fewer devices) with the data position, fall
back from a damaged newest step, and refuse another run's steps."""

from __future__ import annotations

import dataclasses
import functools
import threading
from pathlib import Path

import jax
import numpy as np
import pytest

from resihp_jax.data import BatchIterator
from resihp_jax.errors import CheckpointError, CheckpointFallbackWarning
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.runtime.recovery.checkpoint import Checkpointer, room_beside_steps
from resihp_jax.runtime.trainer.records import run_step
from resihp_jax.runtime.recovery.run_identity import data_identity, json_ready
from resihp_jax.runtime.run.programs import preset_programs
from resihp_jax.models.optimizer import AdamWConfig
from resihp_jax.step.config import StepConfig
from resihp_jax.step.reshard import to_canonical
from tests.helpers import AtOnce, llama_step, max_relative_error, step_program

CFG = get_model_config("tiny")
M, B, S = 6, 2, 64


def _data(seed: int = 0, state: dict | None = None) -> BatchIterator:
    return BatchIterator("synthetic:bimodal", n_microbatches=M, microbatch_size=B, seq_len=S,
                         seed=seed, state=state)


def test_restore_onto_fewer_devices_continues_exactly(tmp_path: Path) -> None:
    big = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    small = Plan(3, 2, 1, (6, 1, 0, 3, 4, 2), (1, 3), (2, 2, 2), B, S)
    program = step_program(CFG, StepConfig(), big)
    state, data = program.init_state(0), _data()
    ckpt = Checkpointer(tmp_path / "ckpt", interval=2)
    for _ in range(2):
        state, record = run_step(program, state, data.next_batch())
    assert ckpt.save(record.step, state, program, data.state())
    ckpt.wait()
    expected_params = jax.device_get(to_canonical(state, program).params)
    _, expected = run_step(program, state, data.next_batch())  # the uninterrupted next step

    target = step_program(CFG, StepConfig(), small)
    restored = Checkpointer(tmp_path / "ckpt").restore(target)
    assert restored.step == 2 and restored.plan == big
    assert max_relative_error(jax.device_get(to_canonical(restored.state, target).params),
                              expected_params) == 0.0
    _, record = run_step(target, restored.state, _data(state=restored.data_state).next_batch())
    np.testing.assert_allclose(record.loss, expected.loss, rtol=1e-5)
    assert record.step == expected.step == 3


def test_missing_checkpoints_are_clear_errors(tmp_path: Path) -> None:
    program = llama_step(CFG, StepConfig(), Plan.uniform(
        1, 1, 1, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S))
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        Checkpointer(tmp_path / "empty").restore(program)
    ckpt = Checkpointer(tmp_path / "one", interval=1)
    ckpt.save(1, program.init_state(0), program, _data().state())
    ckpt.wait()
    with pytest.raises(CheckpointError, match="no checkpoint for step 7"):
        ckpt.restore(program, step=7)
    with pytest.raises(CheckpointError, match="interval=0"):
        Checkpointer(tmp_path / "x", interval=0)


def test_restoring_into_another_model_is_refused(tmp_path: Path) -> None:
    plan = Plan.uniform(1, 1, 1, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    program = step_program(CFG, StepConfig(), plan)
    ckpt = Checkpointer(tmp_path / "c", interval=1)
    ckpt.save(1, program.init_state(0), program, _data().state())
    ckpt.wait()
    other = get_model_config("tiny", d_model=32, d_ff=64)
    with pytest.raises(CheckpointError, match="does not match"):
        ckpt.restore(step_program(other, StepConfig(), plan))


def _trained(program, steps: int, data: BatchIterator, state=None):
    state = program.init_state(0) if state is None else state
    for _ in range(steps):
        state, _ = run_step(program, state, data.next_batch())
    return state


def _canonical_params(state, program):
    return jax.device_get(to_canonical(state, program).params)


@functools.cache
def _program():  # noqa: ANN202 - one compiled program shared by the tests below
    plan = Plan.uniform(1, 1, 1, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    return step_program(CFG, StepConfig(), plan)


def test_async_save_keeps_the_saved_step_although_buffers_are_donated(tmp_path: Path) -> None:
    program = _program()
    data = _data()
    state = _trained(program, 3, data)
    expected = _canonical_params(state, program)
    ckpt = Checkpointer(tmp_path / "c", interval=3, asynchronous=True)
    assert ckpt.save(3, state, program, data.state())
    later = _trained(program, 2, data, state)  # donates the saved state's buffers
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state.params))
    ckpt.wait()
    restored = ckpt.restore(program)
    assert restored.step == 3
    assert max_relative_error(_canonical_params(restored.state, program), expected) == 0.0
    assert max_relative_error(_canonical_params(later, program), expected) > 0.0


def test_a_save_is_handed_off_and_the_steps_go_on_while_it_is_copied_and_written(
        tmp_path: Path) -> None:
    """One process: `save` returns once the state's canonical copy is dispatched; the copy to
    host and orbax's write start in a thread. Held there, the steps go on (donating the state
    saved), a due save is put off, and the save released writes the step as it was."""
    program, data = _program(), _data()
    state = _trained(program, 1, data)
    expected = _canonical_params(state, program)
    ckpt = Checkpointer(tmp_path / "c", interval=1, asynchronous=True)
    release, released_first = threading.Event(), []
    real_save = ckpt._manager.save

    def held_save(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        # (the timeout only keeps a broken hand-off from hanging the suite: it then fails)
        released_first.append(release.wait(timeout=120))
        return real_save(*args, **kwargs)

    ckpt._manager.save = held_save
    assert ckpt.save(1, state, program, data.state())  # the write is held: no wait here
    state = _trained(program, 1, data, state)  # donates the buffers of the state saved
    assert not ckpt.save(2, state, program, data.state())  # due, put off: step 1 is writing
    assert ckpt.saving() and ckpt.stats.put_off == 1
    release.set()
    ckpt.wait()
    assert released_first == [True]
    assert ckpt.stats.saves == 1 and ckpt.stats.waits_on_previous_save == 0
    restored = ckpt.restore(program)
    assert restored.step == 1
    assert max_relative_error(_canonical_params(restored.state, program), expected) == 0.0
    ckpt.close()


def test_a_handed_off_save_that_fails_is_raised_by_the_next_save_not_by_a_look(
        tmp_path: Path) -> None:
    """A failed write surfaces as one CheckpointError naming its step at the next `save` (or
    `wait`), never from `saving()`, which a step's deadline asks while the step runs."""
    program, data = _program(), _data()
    state = _trained(program, 1, data)
    ckpt = Checkpointer(tmp_path / "c", interval=1, asynchronous=True, handoff=AtOnce())

    def full_disk(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError("No space left on device")

    ckpt._manager.save = full_disk
    assert ckpt.save(1, state, program, data.state())  # handed off; it fails there
    assert not ckpt.saving()
    with pytest.raises(CheckpointError, match="saving checkpoint step 1 .* No space left"):
        ckpt.save(2, state, program, data.state())
    ckpt.close()


def test_a_copy_is_handed_off_only_where_the_devices_have_room_for_it_beside_a_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy handed off outlives the save call, on top of the next steps' peak: a device
    whose peak plus its share of the copy passes its limit saves on the loop instead."""
    from resihp_jax.runtime.recovery import checkpoint as checkpoint_module

    program, data = _program(), _data()
    state = _trained(program, 1, data)
    copy = to_canonical(state, program)
    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(copy))  # one device holds it all
    assert room_beside_steps(copy, lambda device: None)  # CPUs: no statistics, the host's
    assert room_beside_steps(copy, lambda d: {"bytes_limit": 10 * nbytes,
                                              "peak_bytes_in_use": 9 * nbytes})
    assert not room_beside_steps(copy, lambda d: {"bytes_limit": 10 * nbytes,
                                                  "peak_bytes_in_use": 9 * nbytes + 1})

    class Counting(AtOnce):
        submitted = 0

        def submit(self, fn, /, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            Counting.submitted += 1
            return super().submit(fn, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "room_beside_steps", lambda copy: False)
    ckpt = Checkpointer(tmp_path / "c", interval=1, asynchronous=True, handoff=Counting())
    assert ckpt.save(1, state, program, data.state())
    assert Counting.submitted == 0  # saved on the loop, as in a job
    monkeypatch.setattr(checkpoint_module, "room_beside_steps", lambda copy: True)
    ckpt.wait()
    assert ckpt.save(2, state, program, data.state())
    assert Counting.submitted == 1
    ckpt.wait()
    assert ckpt.latest_step() == 2
    ckpt.close()


def _largest_file(step_dir: Path) -> Path:
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _two_saves(directory: Path, program) -> tuple[Checkpointer, dict]:
    """Checkpoints at steps 2 and 4; returns the checkpointer and step 2's parameters."""
    data = _data()
    ckpt = Checkpointer(directory, interval=2, keep=2)
    state = _trained(program, 2, data)
    ckpt.save(2, state, program, data.state())
    step2 = _canonical_params(state, program)
    state = _trained(program, 2, data, state)
    ckpt.save(4, state, program, data.state())
    ckpt.wait()
    return ckpt, step2


@pytest.mark.parametrize("damage", [
    lambda d: _flip_a_bit(_largest_file(d / "state")),  # orbax itself reads it "fine"
    lambda d: _truncate(_largest_file(d / "state")),
    lambda d: (d / "meta" / "metadata").unlink(),
    lambda d: (d / "state" / "_METADATA").unlink(),
], ids=["flipped-bit", "truncated", "no-meta", "no-array-metadata"])
def test_a_damaged_newest_step_falls_back_to_the_previous_good_one(tmp_path: Path,
                                                                   damage) -> None:
    program = _program()
    ckpt, step2 = _two_saves(tmp_path / "c", program)
    damage(tmp_path / "c" / "4")
    with pytest.warns(CheckpointFallbackWarning, match="step 4 .* restored step 2") as seen:
        restored = ckpt.restore(program)
    assert len(seen) == 1 and "\n" not in str(seen[0].message)
    assert restored.step == 2 and restored.skipped == (4,)
    assert max_relative_error(_canonical_params(restored.state, program), step2) == 0.0
    assert (tmp_path / "c" / "4.corrupt").is_dir() and ckpt.latest_step() == 2
    assert ckpt.save(4, restored.state, program, _data().state())  # step 4 can be written anew


def test_no_good_step_or_a_damaged_explicit_step_is_an_error(tmp_path: Path) -> None:
    program = _program()
    ckpt, _ = _two_saves(tmp_path / "c", program)
    (tmp_path / "c" / "4" / "meta" / "metadata").unlink()
    with pytest.raises(CheckpointError, match="step 4 .* is unreadable"):
        ckpt.restore(program, step=4)
    (tmp_path / "c" / "2" / "meta" / "metadata").unlink()
    with pytest.raises(CheckpointError, match="no good checkpoint in .*step 4.*step 2"):
        ckpt.restore(program)


def test_another_runs_checkpoint_is_refused_naming_both_values(tmp_path: Path) -> None:
    program = _program()
    data = _data()
    ours = preset_programs(CFG, S)[1].identity(data.state())
    ckpt = Checkpointer(tmp_path / "c", interval=1, identity=ours)
    ckpt.save(1, program.init_state(0), program, data.state())
    ckpt.wait()
    theirs = preset_programs(CFG, S, optimizer=AdamWConfig(learning_rate=1e-3))[1].identity(
        _data(seed=5).state())
    # (the warm-up's first rate: a tenth of the peak)
    with pytest.raises(CheckpointError, match=r"optimizer\.hyperparams\.1\.learning_rate="
                                              r"0\.0003 in the checkpoint, 0\.0001 in this "
                                              r"run.*"
                                              r"data\.seed=0 in the checkpoint, 5 in this run"):
        Checkpointer(tmp_path / "c", identity=theirs).restore(program)
    assert Checkpointer(tmp_path / "c", identity=ours).restore(program).step == 1


def test_a_checkpoint_of_the_retired_builtin_decoder_is_refused_even_when_forced(
        tmp_path: Path) -> None:
    """Its identity (ModelConfig and optimizer, no state layout) cannot be restored into the
    one step's {shell, blocks}: one line naming the converter, forced or not, before any
    restore."""
    program = _program()
    data = _data()
    ours = preset_programs(CFG, S)[1].identity(data.state())
    retired = json_ready({"model": dataclasses.asdict(CFG),
                          "optimizer": dataclasses.asdict(AdamWConfig()),
                          **data_identity(data.state())})
    ckpt = Checkpointer(tmp_path / "c", interval=1, identity=retired)
    ckpt.save(1, program.init_state(0), program, data.state())
    ckpt.wait()
    for force in (False, True):
        with pytest.raises(CheckpointError, match=r"retired built-in decoder's state.*convert "
                                                  r"it first with `python tools/convert_decoder"):
            Checkpointer(tmp_path / "c", identity=ours, force_identity=force).restore(program)


class _Writes:
    """Orbax's manager as the step deadline sees it: a write stays under way until ended."""

    def __init__(self, clock: list[float] | None = None, call_s: float = 0.0) -> None:
        self.under_way = False
        self.clock, self.call_s = clock, call_s  # a save call advances `clock` by `call_s`

    def reached_preemption(self, step: int) -> bool:
        return True

    def latest_step(self) -> None:
        return None

    def save(self, step: int, args: object, force: bool) -> bool:
        if self.clock is not None:
            self.clock[0] += self.call_s
        self.under_way = True
        return True

    def is_saving_in_progress(self) -> bool:
        return self.under_way


def test_a_step_beside_an_asynchronous_write_gets_twice_the_longest_write_on_top(
        tmp_path: Path) -> None:
    """Not the start-up deadline for every step that overlaps a write (a hang then took
    120 s to catch), only until a write has been timed, and never more than it."""
    program = llama_step(CFG, StepConfig(), Plan.uniform(
        1, 1, 1, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S))
    state, data = program.init_state(0), _data()
    now = [100.0]
    ckpt = Checkpointer(tmp_path / "c", interval=1, asynchronous=True, clock=lambda: now[0],
                        handoff=AtOnce())
    writes = _Writes()
    ckpt._manager.close()
    ckpt._manager = writes  # type: ignore[assignment]

    def write(step: int, at: float, lasting: float) -> float:
        """Save at `at`; the deadline of a step beside it; the write ends `lasting` later."""
        now[0] = at
        assert ckpt.save(step, state, program, data.state())
        deadline = ckpt.deadline_beside_write(10.0, 120.0)
        now[0] = at + lasting
        writes.under_way = False
        return deadline

    assert ckpt.deadline_beside_write(10.0, 120.0) == 10.0  # nothing being written
    assert write(1, 100.0, 3.0) == 120.0  # no write timed yet: the start-up deadline
    assert ckpt.deadline_beside_write(10.0, 120.0) == 10.0  # ended: the step's own again
    assert write(2, 110.0, 70.0) == 10.0 + 2 * 3.0
    assert write(3, 200.0, 1.0) == 120.0  # 10 + 2 x 70 is past the start-up deadline
    assert ckpt.deadline_beside_write(30.0, 120.0) == 30.0


def test_a_save_may_take_a_multiple_of_the_longest_save_so_far_before_it_counts_as_hung(
        tmp_path: Path) -> None:
    """A peer frozen at a step blocks the others' save of it in orbax's barriers: caught at
    3x the longest save call (at least the floor), plus the length of a write the call must
    wait for, not only at the start-up deadline."""
    program = llama_step(CFG, StepConfig(), Plan.uniform(
        1, 1, 1, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S))
    state, data = program.init_state(0), _data()
    now = [0.0]
    ckpt = Checkpointer(tmp_path / "c", interval=1, asynchronous=True, clock=lambda: now[0],
                        handoff=AtOnce())
    writes = _Writes(now, call_s=2.0)
    ckpt._manager.close()
    ckpt._manager = writes  # type: ignore[assignment]

    def save(step: int, call_s: float, write_s: float | None) -> None:
        """A save call lasting `call_s`, its write ending `write_s` later (None: not yet)."""
        writes.call_s = call_s
        assert ckpt.save(step, state, program, data.state())
        if write_s is not None:
            now[0] += write_s
            writes.under_way = False

    assert ckpt.save_deadline_s(10.0, 3.0, 120.0) == 120.0  # none timed yet
    save(1, 2.0, 0.0)
    assert ckpt.save_deadline_s(10.0, 3.0, 120.0) == 10.0  # 3 x 2 s is under the floor
    save(2, 5.0, 3.0)
    assert ckpt.save_deadline_s(10.0, 3.0, 120.0) == 15.0
    save(3, 5.0, None)  # a write under way: the next call waits for it too
    assert ckpt.save_deadline_s(10.0, 3.0, 120.0) == 15.0 + 2 * 3.0
    save(4, 50.0, 1.0)
    assert ckpt.save_deadline_s(10.0, 3.0, 120.0) == 120.0  # never past the start-up deadline


def test_a_save_due_while_the_last_write_runs_is_put_off_not_waited_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves due faster than the disk writes them: the due step does not wait for the write
    under way (orbax would stall it); the first step that finds the write done saves, with
    its own data position, and the interval goes on from the policy's steps."""
    plan = Plan.uniform(1, 1, 1, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    program = step_program(CFG, StepConfig(), plan)
    state = program.init_state(0)
    ckpt = Checkpointer(tmp_path / "ckpt", interval=2, asynchronous=True,
                        put_off_while_writing=True)
    writing = [True]
    monkeypatch.setattr(ckpt, "saving", lambda: writing[0])
    assert not ckpt.save(2, state, program, {"position": 2})  # due, the write still runs
    assert not ckpt.save(3, state, program, {"position": 3})  # still running: put off again
    writing[0] = False
    assert ckpt.save(3, state, program, {"position": 3})  # done now: the owed save
    assert not ckpt.save(3, state, program, {"position": 3})  # saved already
    ckpt.wait()
    assert ckpt.latest_step() == 3
    assert ckpt.restore(program).data_state == {"position": 3}
    assert not ckpt.save(5, state, program, {"position": 5})  # not due: the interval's steps
    assert ckpt.save(6, state, program, {"position": 6})
    ckpt.wait()
    assert ckpt.latest_step() == 6
    ckpt.close()
