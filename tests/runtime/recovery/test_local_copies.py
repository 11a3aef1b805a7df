"""Survivors' copies on node-local storage (local_copies.py): the exit writes the shards to
each node's own directory and only manifests to the checkpoint directory; a relaunch onto
the same plan restores in place, filling the shards a node lacks (a lost node's, a
non-writer's) from data-parallel replicas, exactly, and so does one onto fewer replicas of
the same stages and tensor split; onto another split each node publishes its files first.
One process poses as four (two devices each) on four nodes: a node's files are readable
only by the devices of that node's processes."""

from __future__ import annotations

import io
from pathlib import Path

import jax
import pytest

from resihp_jax.data import BatchIterator
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.runtime.recovery import local_copies, survivor_copies
from resihp_jax.runtime.recovery.checkpoint import Checkpointer
from resihp_jax.runtime.recovery.host_copies import MANIFEST, HostCopies
from resihp_jax.runtime.recovery.resume import start_state
from resihp_jax.runtime.trainer.records import run_step
from resihp_jax.step.config import StepConfig
from resihp_jax.step.reshard import to_canonical
from tests.helpers import max_relative_error, step_program

CFG = get_model_config("tiny")
M, B, S = 4, 2, 64
PER = 2  # devices per posing process, one process per node


def _data(state: dict | None = None) -> BatchIterator:
    return BatchIterator("synthetic:bimodal", n_microbatches=M, microbatch_size=B, seq_len=S,
                         seed=1, state=state)


PLAN = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)


@pytest.fixture(scope="module")
def trained() -> tuple:
    """`PLAN` after two steps (its step keeps the state: the tests step from it again)."""
    program = step_program(CFG, StepConfig(donate_state=False), PLAN)
    state, data = program.init_state(0), _data()
    for _ in range(2):
        state, _ = run_step(program, state, data.next_batch())
    return program, state, data


def _nodes_write(ckpt_dir: Path, local: Path, program, state, data,  # noqa: ANN001
                 dead: set[int]) -> None:
    """Four posing processes on four nodes keep `state`; all but `dead` write, each to its
    node's local directory."""
    step = int(jax.device_get(state.step))
    for process in range(8 // PER):
        copies = HostCopies(ckpt_dir, f"p{process}", mode="host",
                               devices=range(PER * process, PER * (process + 1)),
                               owner_of=lambda d: d.id // PER,
                               local_root=local / f"node{process}")
        copies.capture(step, state, program, data.state())
        if process not in dead:
            assert copies.dump("a peer died")


def _on_own_node(local: Path):  # noqa: ANN202
    """A file is readable by a device when it is on the node of the device's process."""
    return lambda path, device: path.is_relative_to(local / f"node{device.id // PER}")


def _assert_same_state(got, program, expected) -> None:  # noqa: ANN001
    got = jax.device_get(to_canonical(got, program))
    assert max_relative_error(got.params, expected.params) == 0.0
    assert max_relative_error(got.opt_state, expected.opt_state) == 0.0
    assert int(got.step) == int(expected.step)


def test_shards_go_to_the_local_directory_and_only_manifests_to_the_shared_one(
        tmp_path: Path, trained: tuple) -> None:
    program, state, data = trained
    _nodes_write(tmp_path / "ckpt", tmp_path / "local", program, state, data, dead=set())
    shared = [f for f in (tmp_path / "ckpt").rglob("*") if f.is_file()]
    assert shared and {f.name for f in shared} == {MANIFEST}
    assert list((tmp_path / "local").rglob("*.bin"))
    [copies] = survivor_copies.find(tmp_path / "ckpt")
    assert copies.complete and len(copies.local_manifests) == 4


@pytest.mark.parametrize("dead", [0, 3])
def test_same_plan_restores_in_place_filling_the_lost_node_from_replicas(
        tmp_path: Path, dead: int, trained: tuple) -> None:
    """A node lost (its process wrote nothing; a spare takes its devices, with no files):
    every device's shard comes from its own node or, for the spare's and for shards its own
    node did not write, from a replica over dp; the state is the old one exactly."""
    program, state, data = trained
    expected = jax.device_get(to_canonical(state, program))
    _nodes_write(tmp_path / "ckpt", tmp_path / "local", program, state, data, dead={dead})
    [copies] = survivor_copies.find(tmp_path / "ckpt")
    assert copies.complete
    restored, filled = local_copies.restore_in_place(copies, program,
                                                     _on_own_node(tmp_path / "local"))
    n_leaves = len(jax.tree.leaves(state))
    assert filled >= PER * n_leaves  # at least every shard of the spare's devices
    _assert_same_state(restored, program, expected)
    # and it trains on: the next step is the uninterrupted run's
    _, record = run_step(program, restored, _data(state=copies.data_state).next_batch())
    _, reference = run_step(program, state, _data(state=data.state()).next_batch())
    assert record.step == reference.step and record.loss == reference.loss


def test_in_place_refuses_another_plan_and_shards_no_replica_can_read(
        tmp_path: Path, trained: tuple) -> None:
    program, state, data = trained
    _nodes_write(tmp_path / "ckpt", tmp_path / "local", program, state, data, dead={1})
    [copies] = survivor_copies.find(tmp_path / "ckpt")
    other = PLAN.replace(layers_per_stage=(1, 3))  # another layer split
    assert local_copies.restore_in_place(
        copies, step_program(CFG, StepConfig(), other)) is None
    # nobody can read anything: no replica holds any shard
    assert local_copies.restore_in_place(copies, program, lambda path, device: False) is None


def test_resume_in_place_onto_the_same_split_and_by_publishing_onto_another(
        tmp_path: Path, trained: tuple) -> None:
    """Through start_state, as a relaunch does: the same plan restores in place, and so does
    one data-parallel replica fewer on other devices (what is left after a loss, no spare:
    the state is replicated over dp, so every device's shard is one the copies hold);
    another layer split gets every node's files published into the checkpoint directory
    and restores from there, exactly."""
    program, state, data = trained
    expected = jax.device_get(to_canonical(state, program))
    ckpt = Checkpointer(tmp_path / "ckpt", interval=100, local_copy_dir=tmp_path / "shm")
    assert ckpt.local_copies.is_relative_to(tmp_path / "shm")
    kept = HostCopies(ckpt.directory, "p0", mode="host", local_root=ckpt.local_copies)
    kept.capture(2, state, program, data.state())
    assert kept.dump("a peer died")
    out = io.StringIO()
    start = start_state(program, ckpt, _data(), resume=True, seed=0, primary=True, out=out)
    assert start.source == "survivors@2" and "restored in place" in out.getvalue()
    _assert_same_state(start.state, program, expected)

    for layers, how in (((2, 2), "restored in place"), ((1, 3), "published")):
        small = Plan(1, 2, 2, (4, 5, 6, 7), layers, (4,), B, S)
        target = step_program(CFG, StepConfig(), small)
        out = io.StringIO()
        start = start_state(target, ckpt, _data(), resume=True, seed=0, primary=True, out=out)
        assert start.source == "survivors@2" and how in out.getvalue(), out.getvalue()
        _assert_same_state(start.state, target, expected)
    assert list((ckpt.directory / "survivors").rglob("*.bin"))  # the node's files, published
