"""The survivors' copies of the last step (host_copies.py, survivor_copies.py): with dp=2
the processes left after one dies hold every shard, and the state they wrote restores onto
a smaller plan with the same values and the same next losses; with dp=1 some shard has no
copy left and the resume falls back to the periodic checkpoint, saying so. One process poses
as four (two devices each) through the copies' injected device list."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Callable

import jax
import numpy as np
import pytest

from resihp_jax.data import BatchIterator
from resihp_jax.errors import CheckpointError
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.runtime.recovery import survivor_copies
from resihp_jax.runtime.recovery.checkpoint import Checkpointer
from resihp_jax.runtime.recovery.restore import canonical_target
from resihp_jax.runtime.recovery.host_copies import MANIFEST, HostCopies
from resihp_jax.runtime.trainer.records import run_step
from resihp_jax.runtime.recovery.resume import start_state
from resihp_jax.step.config import StepConfig
from resihp_jax.step.reshard import to_canonical
from tests.helpers import llama_step
from tests.helpers import max_relative_error, step_program

CFG = get_model_config("tiny")
M, B, S = 4, 2, 64


def _data(state: dict | None = None) -> BatchIterator:
    return BatchIterator("synthetic:bimodal", n_microbatches=M, microbatch_size=B, seq_len=S,
                         seed=1, state=state)


def _trained(plan: Plan, steps: int, donate: bool = True) -> tuple:
    program = step_program(CFG, StepConfig(donate_state=donate), plan)
    state, data = program.init_state(0), _data()
    for _ in range(steps):
        state, _ = run_step(program, state, data.next_batch())
    return program, state, data


def _survivors_write(directory: Path, program, state, data, dead: set[int],  # noqa: ANN001
                     mode: str = "host", then: Callable[[], None] = lambda: None,
                     per: int = 2, node_of: Callable[[int], int] | None = None) -> None:
    """Posing processes of `per` devices each (four of two by default) keep the state;
    `then` runs (e.g. the next step, which fails); all but `dead` write. `node_of`: the node
    each process runs on (default: one each)."""
    step = int(jax.device_get(state.step))
    kept = [HostCopies(directory, f"p{process}", mode=mode,
                          devices=range(per * process, per * (process + 1)),
                          owner_of=lambda d: d.id // per, node_of=node_of)
            for process in range(8 // per)]
    for copies in kept:
        copies.capture(step, state, program, data.state())
    then()
    for process, copies in enumerate(kept):
        if process not in dead:
            assert copies.dump("a peer died")


@pytest.mark.parametrize("mode", ["host", "keep"])
def test_copies_of_one_dead_process_restore_onto_a_smaller_plan(tmp_path: Path,
                                                                mode: str) -> None:
    big = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    program, state, data = _trained(big, 2, donate=mode == "host")
    expected = jax.device_get(to_canonical(state, program))
    position = data.state()
    after: list = []

    def next_step() -> None:  # the step the failure interrupts consumes (donates) the state
        after.append(run_step(program, state, data.next_batch())[1])

    _survivors_write(tmp_path, program, state, data, dead={0}, mode=mode, then=next_step)
    [next_record] = after  # what the uninterrupted step 3 gives
    # with donation the consumed state is gone from the devices: only the host copy has it
    assert state.params["shell"]["table"].is_deleted() == (mode == "host")
    data = _data(state=position)

    [copies] = survivor_copies.find(tmp_path)
    assert copies.complete and copies.step == 2 and sorted(copies.hosts) == ["p1", "p2", "p3"]
    small = Plan(1, 2, 2, (2, 3, 4, 5), (1, 3), (4,), B, S)  # what is left, another split
    target = step_program(CFG, StepConfig(), small)
    restored = survivor_copies.restore(copies, target, canonical_target(target))
    got = jax.device_get(to_canonical(restored, target))
    assert max_relative_error(got.params, expected.params) == 0.0
    assert max_relative_error(got.opt_state, expected.opt_state) == 0.0  # Adam moments, count
    assert int(got.step) == 2
    _, record = run_step(target, restored, _data(state=copies.data_state).next_batch())
    assert record.step == 3 and record.batch_crc == next_record.batch_crc  # the same batch
    np.testing.assert_allclose(record.loss, next_record.loss, rtol=1e-5)


def test_with_dp4_two_processes_write_each_shard_and_any_one_lost_is_covered(
        tmp_path: Path) -> None:
    """dp=4: every shard is held by 4 (posing) processes, and written by 2 of them
    (copy_writers.py), so the exit writes half of what all holders would; whichever one
    process is lost, the others' copies restore the state exactly. Two writers of one shard
    lost at once leave the copies incomplete (the resume falls back to the checkpoint)."""
    plan = Plan.uniform(4, 2, 1, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    program, state, data = _trained(plan, 1)
    expected = jax.device_get(to_canonical(state, program))
    written = {}
    for dead in range(8):
        directory = tmp_path / f"dead{dead}"
        _survivors_write(directory, program, state, data, dead={dead}, per=1)
        [copies] = survivor_copies.find(directory)
        assert copies.complete, (dead, copies.missing)
        _assert_restores_exactly(copies, program, expected)
        written[dead] = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    everything = sum(x.nbytes for x in jax.tree.leaves(jax.device_get(state))) * 4
    # seven survivors of eight write about 7/8 of 2 of the 4 replicas
    assert max(written.values()) < 0.6 * everything
    # two lost at once: some pair of processes are both writers of some shard
    incomplete = 0
    for pair in ((0, 1), (0, 2), (1, 3), (4, 6), (5, 7)):
        directory = tmp_path / f"pair{pair}"
        _survivors_write(directory, program, state, data, dead=set(pair), per=1)
        incomplete += not next(survivor_copies.find(directory)).complete
    assert incomplete > 0


def test_with_the_nodes_known_a_lost_node_of_two_processes_is_covered(tmp_path: Path) -> None:
    """dp=4 over 8 posing processes, two on each of 4 nodes (0-1, 2-3, ...): each shard's two
    writers are on two nodes, so whichever node is lost (both its processes at once), the
    copies are complete and restore the state exactly."""
    plan = Plan.uniform(4, 2, 1, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    program, state, data = _trained(plan, 1)
    expected = jax.device_get(to_canonical(state, program))
    for node in range(4):
        directory = tmp_path / f"node{node}"
        _survivors_write(directory, program, state, data, dead={2 * node, 2 * node + 1},
                         per=1, node_of=lambda process: process // 2)
        [copies] = survivor_copies.find(directory)
        assert copies.complete, (node, copies.missing)
        _assert_restores_exactly(copies, program, expected)


def _assert_restores_exactly(copies: survivor_copies.SurvivorCopies, program,  # noqa: ANN001
                             expected) -> None:  # noqa: ANN001
    """`copies` restore, in `program`'s plan, exactly the `expected` (canonical) state."""
    restored = survivor_copies.restore(copies, program, canonical_target(program))
    got = jax.device_get(to_canonical(restored, program))
    assert max_relative_error(got.params, expected.params) == 0.0
    assert max_relative_error(got.opt_state, expected.opt_state) == 0.0


def _checkpointed_at_1_then_trained_to_3(plan: Plan, directory: Path) -> tuple:
    """A run with a periodic checkpoint of step 1 in `directory` and its state at step 3."""
    program, state, data = _trained(plan, 1)
    ckpt = Checkpointer(directory, interval=1)
    ckpt.save(1, state, program, data.state())
    ckpt.wait()
    for _ in range(2):
        state, _ = run_step(program, state, data.next_batch())
    return program, state, data, ckpt


def test_resume_prefers_complete_copies_over_an_older_checkpoint(tmp_path: Path) -> None:
    plan = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    program, state, data, ckpt = _checkpointed_at_1_then_trained_to_3(plan, tmp_path)
    _survivors_write(tmp_path, program, state, data, dead={3})
    out = io.StringIO()
    start = start_state(program, ckpt, _data(), resume=True, seed=0, primary=True, out=out)
    assert (start.step, start.source) == (3, "survivors@3")
    assert "newest periodic checkpoint: step 1" in out.getvalue()


def test_copies_missing_a_shard_fall_back_to_the_checkpoint(tmp_path: Path) -> None:
    plan = Plan.uniform(1, 4, 2, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    program, state, data, ckpt = _checkpointed_at_1_then_trained_to_3(plan, tmp_path)
    _survivors_write(tmp_path, program, state, data, dead={2})  # dp=1: stage 2 has no copy
    [copies] = survivor_copies.find(tmp_path)
    assert not copies.complete and "no surviving copy" in copies.missing
    with pytest.raises(CheckpointError, match="no surviving copy"):
        survivor_copies.restore(copies, program, canonical_target(program))
    out = io.StringIO()
    fresh = _data()
    start = start_state(program, ckpt, fresh, resume=True, seed=0, primary=True, out=out)
    assert (start.step, start.source) == (1, "checkpoint@1")
    assert "incomplete" in out.getvalue() and "falling back to checkpoint step 1" in out.getvalue()
    assert fresh.batches_served == 1  # the data position is the checkpoint's


def test_copies_lacking_a_whole_leaf_fall_back_to_the_checkpoint(tmp_path: Path) -> None:
    """Copies in which no survivor wrote some leaf at all (its only holders were lost: no box
    of it is short, so the set looks complete) are passed over for the checkpoint instead of
    stopping the resume."""
    plan = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    program, state, data, ckpt = _checkpointed_at_1_then_trained_to_3(plan, tmp_path)
    _survivors_write(tmp_path, program, state, data, dead=set())
    gone = None
    for manifest in (tmp_path / "survivors").glob(f"step3/*/{MANIFEST}"):
        written = json.loads(manifest.read_text())
        gone = gone or sorted(written["leaves"])[-1]
        written["leaves"].pop(gone, None)  # as if its holders had died before writing
        manifest.write_text(json.dumps(written))
    [copies] = survivor_copies.find(tmp_path)
    assert copies.complete and gone not in copies.leaves
    with pytest.raises(CheckpointError, match="lack leaf"):
        survivor_copies.restore(copies, program, canonical_target(program))
    out = io.StringIO()
    fresh = _data()
    start = start_state(program, ckpt, fresh, resume=True, seed=0, primary=True, out=out)
    assert (start.step, start.source) == (1, "checkpoint@1")
    assert "copies of step 3 cannot be used" in out.getvalue(), out.getvalue()
    assert fresh.batches_served == 1  # the data position is the checkpoint's


def test_copies_of_another_model_are_refused(tmp_path: Path) -> None:
    plan = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    program, state, data = _trained(plan, 1)
    _survivors_write(tmp_path, program, state, data, dead=set())
    other = llama_step(get_model_config("tiny", d_ff=96), StepConfig(), plan, jax.devices())
    [copies] = survivor_copies.find(tmp_path)
    with pytest.raises(CheckpointError, match="do not match this model"):
        survivor_copies.restore(copies, other, canonical_target(other))


def test_processes_stopped_a_step_apart_restore_the_step_they_share(tmp_path: Path) -> None:
    """p2 finished step 3 before it stopped, p1 was still in it: p1 wrote step 2 only, p2
    steps 3 and 2. Step 3 lacks p1's shards; step 2 is whole and is restored."""
    plan = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    program, state, data = _trained(plan, 2, donate=False)
    expected = jax.device_get(to_canonical(state, program))
    p1 = HostCopies(tmp_path, "p1", mode="keep", devices=(2, 3))
    p2 = HostCopies(tmp_path, "p2", mode="keep", devices=(4, 5))
    for copies in (p1, p2):
        copies.capture(2, state, program, data.state())
    ahead, _ = run_step(program, state, data.next_batch())
    p2.capture(3, ahead, program, data.state())
    assert len(p1.dump("terminated")) == 1 and len(p2.dump("terminated")) == 2
    newest, shared = survivor_copies.find(tmp_path)
    assert (newest.step, newest.complete) == (3, False)
    assert (shared.step, shared.complete) == (2, True)
    out = io.StringIO()
    start = start_state(program, Checkpointer(tmp_path), _data(), resume=True,
                        seed=0, primary=True, out=out)
    assert start.source == "survivors@2" and "copies of step 3 are incomplete" in out.getvalue()
    got = jax.device_get(to_canonical(start.state, program))
    assert max_relative_error(got.params, expected.params) == 0.0


def test_auto_keeps_the_states_on_the_devices_only_where_two_more_fit() -> None:
    from resihp_jax.runtime.recovery.host_copies import auto_mode  # noqa: PLC0415

    gib = 2**30
    # an 80 GB accelerator: a 1B model's 14 GB state twice beside a 30 GB step fits
    assert auto_mode("gpu", 30 * gib, 14 * gib, 80 * gib) == "keep"
    # a 70B shard that fills most of the device: copies go to host memory instead
    assert auto_mode("gpu", 60 * gib, 14 * gib, 80 * gib) == "host"
    # a device that reports no memory limit: assume it does not fit
    assert auto_mode("tpu", 1 * gib, 1 * gib, None) == "host"
    # CPU "device memory" is host memory: keeping costs nothing there
    assert auto_mode("cpu", 60 * gib, 14 * gib, None) == "keep"


def test_copies_rewritten_under_another_plan_are_judged_apart(tmp_path: Path) -> None:
    """A relaunch that fails again before its first step rewrites the step it restored under
    its own plan: the step then holds two plans' shards, which do not tile each other. The
    complete plan's copies are found first; a step removed meanwhile is passed over."""
    big = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    program, state, data = _trained(big, 2)
    _survivors_write(tmp_path, program, state, data, dead={0})  # 3 of 4 hosts: complete
    small = Plan(1, 2, 2, (2, 3, 4, 5), (1, 3), (4,), B, S)
    target = step_program(CFG, StepConfig(), small)
    [copies] = survivor_copies.find(tmp_path)
    moved = survivor_copies.restore(copies, target, canonical_target(target))
    # one process of the relaunch (its own name: another pid) rewrites step 2 and fails
    again = HostCopies(tmp_path, "p1-relaunched", mode="host", devices=(2, 3))
    again.capture(2, moved, target, data.state())
    assert again.dump("the relaunch failed too")
    whole, partial = survivor_copies.find(tmp_path)
    assert whole.complete and sorted(whole.hosts) == ["p1", "p2", "p3"]
    assert not partial.complete and partial.hosts == ("p1-relaunched",)
    assert "no surviving copy of" in partial.missing and " -" not in partial.missing
    older = tmp_path / survivor_copies.SUBDIR / "step1"
    older.mkdir()
    found = survivor_copies.find(tmp_path)
    assert next(found).step == 2
    older.rmdir()  # process 0, resumed from step 2, tidies older steps away meanwhile
    assert [c.step for c in found] == [2]  # the partial copies of step 2; step 1 passed over


def test_a_step_finished_on_the_devices_is_kept_when_a_later_collective_fails(
        tmp_path: Path) -> None:
    """A peer died while this process was in the collectives after step 3 (its peers got
    past them and kept step 3): the trainer's finished step 3 is kept on the error path too,
    with the data position after it, so the survivors' copies of step 3 are whole. A state
    a failed step donated is left alone."""
    from types import SimpleNamespace

    from resihp_jax.runtime.run.process import keep_completed

    plan = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    program, state, data = _trained(plan, 2, donate=False)
    kept = HostCopies(tmp_path, "p0", mode="keep")
    kept.capture(2, state, program, data.state())
    ahead, _ = run_step(program, state, data.next_batch())  # step 3, never yielded
    trainer = SimpleNamespace(completed=3, state=ahead, program=program, data=data)
    assert keep_completed(kept, trainer) and kept.newest_step == 3
    assert not keep_completed(kept, trainer)  # kept already
    assert kept.dump("a peer died")
    [newest, older] = survivor_copies.find(tmp_path)
    assert (newest.step, older.step) == (3, 2) and newest.data_state == data.state()
    # a step that failed after donating the state: nothing to keep
    later = HostCopies(tmp_path / "later", "p0", mode="keep")
    later.capture(2, state, program, data.state())
    jax.tree.map(lambda leaf: leaf.delete(), ahead)
    assert not keep_completed(later, trainer) and later.newest_step == 2
