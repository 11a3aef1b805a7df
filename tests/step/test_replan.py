"""Re-planning changes speed, never the training math; split changes never recompile."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.models.optimizer import AdamWConfig
from resihp_jax.step.config import StepConfig
from resihp_jax.step.reshard import move_state, to_canonical
from resihp_jax.step.staging import HostStaging
from resihp_jax.step.program import route_microbatches, routed_groups
from tests.helpers import llama_step, make_batches, max_relative_error

CFG = get_model_config("tiny")
M, B, S = 6, 2, 64
TRAIN = StepConfig()
ADAMW = AdamWConfig(learning_rate=1e-2, warmup_steps=0)


def _run(plans: list[Plan], batches: list) -> tuple[list[float], object]:
    """Train one step per batch, switching to plans[i] before step i when it changes."""
    program = llama_step(CFG, TRAIN, plans[0], jax.devices(), optimizer=ADAMW)
    state = program.init_state(0)
    losses = []
    for plan, batch in zip(plans, batches):
        if plan != program.plan:
            new = llama_step(CFG, TRAIN, plan, jax.devices(), optimizer=ADAMW)
            state, program = move_state(state, program, new), new
        arrays = (batch.tokens_MxBxS, batch.segment_ids_MxBxS, batch.positions_MxBxS)
        state, metrics = program.step(state, program.shard_batch(*arrays))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(to_canonical(state, program))


def test_switching_plan_mid_run_matches_never_switching() -> None:
    batches = make_batches(M, B, S, n_batches=6, seed=1)
    fixed = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)
    # After step 3: six of the eight devices, a new mesh shape, uneven splits.
    smaller = Plan(3, 2, 1, (5, 0, 2, 7, 1, 4), (3, 1), (1, 2, 3), B, S)
    ref_losses, ref_state = _run([fixed] * 6, batches)
    losses, state = _run([fixed] * 3 + [smaller] * 3, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert ref_losses[-1] < ref_losses[0]  # it does train
    assert max_relative_error(state.params, ref_state.params) < 1e-4
    assert int(state.step) == 6


def test_changing_only_the_splits_does_not_recompile() -> None:
    batch = make_batches(4, B, S)[0]
    arrays = (batch.tokens_MxBxS, batch.segment_ids_MxBxS, batch.positions_MxBxS)
    plan = Plan(2, 2, 2, tuple(range(8)), (1, 3), (3, 1), B, S)
    program = llama_step(CFG, StepConfig(), plan, jax.devices())
    state = program.init_state(0)
    state, _ = program.step(state, program.shard_batch(*arrays))
    for layers, mbs in [((2, 2), (2, 2)), ((3, 1), (1, 3))]:
        moved = program.with_plan(plan.replace(layers_per_stage=layers,
                                               microbatches_per_group=mbs))
        state = move_state(state, program, moved)
        program = moved
        state, _ = program.step(state, program.shard_batch(*arrays))
    assert program.step_fn._cache_size() == 1


def test_with_plan_rejects_a_new_mesh() -> None:
    plan = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=4, microbatch_size=B, seq_len=S)
    program = llama_step(CFG, StepConfig(), plan, jax.devices())
    with pytest.raises(ValueError, match="same mesh"):
        program.with_plan(plan.replace(device_ids=tuple(reversed(range(8)))))


def test_each_dp_group_reads_only_its_own_microbatches() -> None:
    """What a host holding only some DP groups reads: make_array_from_callback asks for the
    slots of those groups, and only their micro-batches are read."""
    plan = Plan(3, 2, 1, (5, 0, 2, 7, 1, 4), (3, 1), (1, 2, 3), B, S)
    tokens_MxBxS = np.arange(6 * B * S, dtype=np.int32).reshape(6, B, S)
    read = []

    def read_microbatch(m: int) -> np.ndarray:
        read.append(m)
        return tokens_MxBxS[m]

    slots = routed_groups(read_microbatch, (B, S), np.int32, plan, 3, range(1, 3))
    assert read == [1, 2, 3, 4, 5]  # group 0 holds micro-batch 0, which is never read
    np.testing.assert_array_equal(slots, route_microbatches(tokens_MxBxS, plan, 3)[1:3])
    program = llama_step(CFG, StepConfig(), plan, jax.devices())
    read.clear()
    lazy = program.shard_microbatches(read_microbatch, tokens_MxBxS, tokens_MxBxS)
    eager = program.shard_batch(tokens_MxBxS, tokens_MxBxS, tokens_MxBxS)
    assert sorted(read) == list(range(6))  # one process holds every group: each read once
    for a, b in zip(lazy, eager):
        np.testing.assert_array_equal(jax.device_get(a), jax.device_get(b))
        assert a.sharding == b.sharding


def test_canonical_state_is_spread_over_the_mesh_not_replicated() -> None:
    """Checkpoints and moves between meshes go through the canonical layout: no device may
    hold more of it than of its own stage state (replicated, a 70B state / tp per GPU)."""
    plan = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=4, microbatch_size=B, seq_len=S)
    program = llama_step(CFG, TRAIN, plan, jax.devices(), optimizer=ADAMW)
    state = program.init_state(0)
    canonical = to_canonical(state, program)

    def device_bytes(tree) -> int:
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))

    assert device_bytes(canonical) < device_bytes(state)
    wq = canonical.params["blocks"]["wq"]
    assert wq.addressable_shards[0].data.size * 8 == wq.size  # over dp x pp x tp


def test_a_move_onto_other_devices_equals_the_canonical_route() -> None:
    """The host route of a mesh change (each block read once, one numpy gather, one
    placement) gives the very arrays and shardings of the device route through the canonical
    layout, empty slots zero, without reading a device the new plan leaves out (its buffers
    are gone here: dp holds a copy of each); moving back restores the state exactly."""
    from resihp_jax.step.reshard import from_canonical

    start = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=4, microbatch_size=B, seq_len=S)
    src = llama_step(CFG, TRAIN, start, jax.devices(), optimizer=ADAMW)
    dst = llama_step(CFG, TRAIN, Plan(1, 3, 2, (7, 6, 0, 1, 3, 2), (1, 2, 1), (4,), B, S),
                     jax.devices(), optimizer=ADAMW)
    state = src.init_state(3)
    before = [np.asarray(x) for x in jax.tree.leaves(state)]
    expected = from_canonical(to_canonical(state, src), dst)
    for x in jax.tree.leaves(state):  # device 5 stopped: what it held is lost
        for shard in x.addressable_shards:
            if shard.device.id == 5:
                shard.data.delete()
    moved = move_state(state, src, dst)
    for got, want in zip(jax.tree.leaves(moved), jax.tree.leaves(expected)):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # the same move through host buffers reserved ahead of time: same arrays, buffers used
    staging = HostStaging(budget_bytes=2**31)
    assert staging.reserve(dst.abstract_state()) > 0
    staged = move_state(state, src, dst, staging)
    assert staging.held_bytes == 0
    for got, want in zip(jax.tree.leaves(staged), jax.tree.leaves(expected)):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert dst.stage_index().min() < 0  # the new layout has empty slots, and they are zero
    back = move_state(moved, dst, src)
    for got, want in zip(jax.tree.leaves(back), before):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_the_host_gather_reads_blocks_split_along_any_axis() -> None:
    """Row r of the flattened [stages, slots] axes, zeros for -1, whether the blocks split
    the stage axis only (every sharding rule) or the slot axis too."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from resihp_jax.step.reshard import _gather_rows

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    x_PxLxX = np.arange(2 * 4 * 4, dtype=np.float32).reshape(2, 4, 4)
    rows = np.array([5, -1, 0, 7, 2])
    want = x_PxLxX.reshape(8, 4)[np.clip(rows, 0, None)] * (rows >= 0)[:, None]
    for spec in (P("a"), P("a", "b"), P(None, None, "b")):
        placed = jax.device_put(x_PxLxX, NamedSharding(mesh, spec))
        out = np.zeros((rows.size, 4), np.float32)
        _gather_rows(placed, rows, {0, 1}, out)
        np.testing.assert_array_equal(out, want)
