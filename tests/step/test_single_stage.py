"""A one-stage plan's step is gradient accumulation: as many matmuls as a plain
`jax.jit(jax.value_and_grad(...))` step of the same model (no pipeline gates re-running the
forward in the backward), the same values as the single-device reference, and remat still
recomputes."""

from __future__ import annotations

import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from resihp_jax.faults.injector import FaultInjector
from resihp_jax.meshes import layout
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.nn.layers import next_token_targets
from resihp_jax.runtime.trainer.timing import StageTimer, timed_step
from resihp_jax.step.config import StepConfig
from resihp_jax.step.instrument import (BWD_END, BWD_START, FWD_END, FWD_START, Instrument,
                                         chain_hosts)
from resihp_jax.step.program import matmul_count
from resihp_jax.step.model_parts import split_model
from resihp_jax.step.body import token_nll_sum
from resihp_jax.step.builder import build_model_step
from tests.helpers import llama_step
from tests.helpers import (canonical_grads, llama_loss_sum, llama_params, make_batches,
                           max_relative_error, reference_loss_and_grads)
from tests.step.test_bf16 import _dot_operand_dtypes
from tests.step.test_train_equivalence import BF16_GRAD_TOL, BF16_LOSS_RTOL
from tests.step.user_models import make_gpt2

CFG = get_model_config("tiny")
M, B, S = 4, 2, 32


def _flat(batch) -> list[jax.Array]:
    """The global batch as one [M * B, S] batch: what a plain step trains on."""
    return [jnp.asarray(a.reshape(-1, a.shape[-1])) for a in
            (batch.tokens_MxBxS, batch.segment_ids_MxBxS, batch.positions_MxBxS)]


def _ours(program, params, batch) -> tuple[jax.stages.Lowered, jax.stages.Compiled]:
    sharded = program.shard_batch(batch.tokens_MxBxS, batch.segment_ids_MxBxS,
                                  batch.positions_MxBxS)
    lowered = program.loss_and_grads_fn.lower(params, sharded, program.splits())
    return lowered, lowered.compile()


def _temp_ratio(ours: jax.stages.Compiled, peer: jax.stages.Compiled, what: str) -> float:
    ratio = (ours.memory_analysis().temp_size_in_bytes
             / max(peer.memory_analysis().temp_size_in_bytes, 1))
    print(f"{what}: temp bytes ours / peer = {ratio:.2f}")  # reported, not asserted
    return ratio


def _llama_peer(cfg, batch) -> jax.stages.Lowered:
    tokens, seg, pos = _flat(batch)
    loss_sum = llama_loss_sum(cfg)
    loss = lambda p: loss_sum(p, tokens, seg, pos)[0]  # noqa: E731
    return jax.jit(jax.value_and_grad(loss)).lower(llama_params(cfg, 0))


def test_llama_one_stage_step_has_the_plain_steps_matmuls() -> None:
    # one block: the plain step runs the model's Python loop over its blocks (each written
    # out), ours scans over the stacked blocks (written once): one block compares like for like
    cfg = CFG.replace(n_layers=1)
    plan = Plan.uniform(1, 1, 1, n_layers=1, n_microbatches=M, microbatch_size=B, seq_len=S)
    batch = make_batches(M, B, S)[0]
    peer = _llama_peer(cfg, batch)
    program = llama_step(cfg, StepConfig(), plan, jax.devices()[:1])
    lowered, compiled = _ours(program, program.init_state(0).params, batch)
    assert matmul_count(lowered) == matmul_count(peer)
    peer_compiled = peer.compile()
    assert matmul_count(compiled) == matmul_count(peer_compiled)
    _temp_ratio(compiled, peer_compiled, "Llama tiny (1 block), 1/1/1")
    # a recomputing step is seen: remat re-runs each layer's forward matmuls
    remat = llama_step(cfg, StepConfig(remat=True), plan, jax.devices()[:1])
    remat_lowered, _ = _ours(remat, remat.init_state(0).params, batch)
    assert matmul_count(remat_lowered) > matmul_count(peer)


def _user_setup(n_layers: int):
    model = make_gpt2(n_layers=n_layers)
    parts, shell, blocks = split_model(model)
    return model, parts, {"shell": shell, "blocks": blocks}


def _user_reference(model, batch) -> tuple[jax.Array, object]:
    """The user's own model under a plain jit(value_and_grad): loss and gradients."""
    graphdef, state = nnx.split(model)
    tokens, seg, pos = _flat(batch)

    def mean_loss(s):
        targets, weights = next_token_targets(tokens, seg)
        logits = nnx.merge(graphdef, s)(tokens, seg, pos)
        return token_nll_sum(logits, targets, weights) / jnp.maximum(weights.sum(), 1)

    return jax.jit(jax.value_and_grad(mean_loss)).lower(state), state


def test_user_one_stage_step_has_the_plain_steps_matmuls() -> None:
    # one block: the user's model loops over its blocks in Python (each written out), ours
    # scans over the stacked blocks (written once), so only one block compares like for like
    model, parts, params = _user_setup(n_layers=1)
    plan = Plan.uniform(1, 1, 1, n_layers=1, n_microbatches=M, microbatch_size=B, seq_len=S)
    batch = make_batches(M, B, S, seed=5)[0]
    peer, _ = _user_reference(model, batch)
    program = build_model_step(parts, optax.sgd(0.1), plan, jax.devices()[:1], params)
    lowered, compiled = _ours(program, program.init_state(params).params, batch)
    assert matmul_count(lowered) == matmul_count(peer)
    peer_compiled = peer.compile()
    assert matmul_count(compiled) == matmul_count(peer_compiled)
    _temp_ratio(compiled, peer_compiled, "user GPT-2 (1 block), 1/1/1")


COPY = re.compile(r"= \S+ copy(?:-start)?\(")


def test_a_one_slot_user_step_copies_no_more_than_the_plain_step() -> None:
    """One micro-batch a group: our step against the user's own jit step applying the same
    SGD update, state donated. A step of one slot (which every group fills) has no slot loop
    and no branch to add buffer copies around it (with them: 32 copies against the peer's 31;
    without: 25)."""
    model, parts, params = _user_setup(n_layers=1)
    plan = Plan.uniform(1, 1, 1, n_layers=1, n_microbatches=1, microbatch_size=M * B,
                        seq_len=S)
    batch = make_batches(1, M * B, S, seed=5)[0]
    program = build_model_step(parts, optax.sgd(0.1), plan, jax.devices()[:1], params)
    _, ours = _ours(program, program.init_state(params).params, batch)
    graphdef, state = nnx.split(model)
    tokens, seg, pos = _flat(batch)
    sgd = optax.sgd(0.1)

    def plain_step(s, opt_state):
        def mean_loss(s):
            targets, weights = next_token_targets(tokens, seg)
            logits = nnx.merge(graphdef, s)(tokens, seg, pos)
            return token_nll_sum(logits, targets, weights) / jnp.maximum(weights.sum(), 1)
        loss, grads = jax.value_and_grad(mean_loss)(s)
        updates, opt_state = sgd.update(grads, opt_state, s)
        return optax.apply_updates(s, updates), opt_state, loss

    peer = jax.jit(plain_step, donate_argnums=(0, 1)).lower(state, sgd.init(state)).compile()
    assert matmul_count(ours) == matmul_count(peer)
    ours_copies, peer_copies = (len(COPY.findall(c.as_text())) for c in (ours, peer))
    assert 0 < ours_copies <= peer_copies, (ours_copies, peer_copies)


UNEVEN = Plan.uniform(2, 1, 2, n_layers=CFG.n_layers, n_microbatches=M, microbatch_size=B,
                      seq_len=S).replace(microbatches_per_group=(1, 3))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama_data_parallel_one_stage_uneven_split_equals_the_reference(dtype: str) -> None:
    """Float32 to the reference's tolerance; bf16 compute (float32 masters, every matmul in
    bf16, gradients accumulated in float32) to the bf16 tolerance every plan is held to."""
    batch = make_batches(M, B, S)[0]
    ref_loss, ref_grads = reference_loss_and_grads(CFG, llama_params(CFG, 0), batch)
    program = llama_step(get_model_config("tiny", dtype=dtype), StepConfig(), UNEVEN,
                         jax.devices()[:4])
    params, sharded = program.init_state(0).params, program.shard_batch(
        batch.tokens_MxBxS, batch.segment_ids_MxBxS, batch.positions_MxBxS)
    loss, grads = program.loss_and_grads(params, sharded)
    loss_rtol, grad_tol = (1e-5, 1e-4) if dtype == "float32" else (BF16_LOSS_RTOL, BF16_GRAD_TOL)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=loss_rtol)
    grads = canonical_grads(program, grads)
    assert all(g.dtype == np.float32 for g in jax.tree.leaves(grads))
    assert max_relative_error(grads, jax.device_get(ref_grads)) < grad_tol
    jaxpr = jax.make_jaxpr(program.loss_and_grads_fn)(params, sharded, program.splits())
    assert set(_dot_operand_dtypes(jaxpr.jaxpr)) == {(dtype, dtype)}


@pytest.mark.parametrize("remat", [False, True])
def test_own_data_parallel_one_stage_uneven_split_equals_the_model(remat: bool) -> None:
    model, parts, params = _user_setup(n_layers=2)
    plan = UNEVEN.replace(layers_per_stage=(2,))
    batch = make_batches(M, B, S, seed=5)[0]
    program = build_model_step(parts, optax.sgd(0.1), plan, jax.devices()[:4], params,
                              train=StepConfig(remat=remat))
    loss, grads = program.loss_and_grads(program.init_state(params).params, program.shard_batch(
        batch.tokens_MxBxS, batch.segment_ids_MxBxS, batch.positions_MxBxS))
    grads = jax.device_get(layout.to_canonical_layout(grads, program.canonical_positions()))
    peer, state = _user_reference(model, batch)
    want_loss, want = peer.compile()(state)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    want = nnx.to_pure_dict(want)
    want_blocks = want.pop("blocks")
    stacked = [np.stack(x) for x in zip(*(jax.tree.leaves(want_blocks[i]) for i in range(2)))]
    assert max_relative_error(jax.tree.leaves(grads["blocks"]), stacked) < 1e-4
    assert max_relative_error(jax.tree.leaves(grads["shell"]), jax.tree.leaves(want)) < 1e-4


def test_stage_timing_and_an_injected_slowdown_reach_a_one_stage_step() -> None:
    """The markers bracket each micro-batch's layers, forward and backward: every device
    times its slot-0 forward, and a slowed device's injector delays each of its busy
    regions (forward and backward of each of its group's micro-batches) and no other's."""
    lock, slept, seen = threading.Lock(), [], []

    def fake_sleep(seconds: float) -> None:
        with lock:
            slept.append(seconds)

    def record(event: int, dp: int, pp: int, tp: int, knob: float, busy: bool,
               tick: int) -> None:
        with lock:
            seen.append((event, (dp, pp, tp), knob, tick))

    injector, timer = FaultInjector(UNEVEN, sleep=fake_sleep), StageTimer((2, 1, 2))
    program = llama_step(CFG, StepConfig(), UNEVEN, jax.devices()[:4],
                         Instrument(chain_hosts(injector, record, timer)))
    batch = make_batches(M, B, S)[0]
    sharded = program.shard_batch(batch.tokens_MxBxS, batch.segment_ids_MxBxS,
                                  batch.positions_MxBxS)
    slow = UNEVEN.coords_of(3)
    assert slow[0] == 1  # the group with 3 micro-batches
    injector.slow(3, 4.0)
    _, metrics, timing = timed_step(program, program.init_state(0), sharded,
                                    injector.knobs(0), timer)
    assert np.isfinite(float(metrics["loss"]))
    assert np.all(timing.fwd_DxPxT > 0)  # every device's slot-0 forward was timed
    slowed = {(e, t) for e, c, k, t in seen if c == slow}
    assert slowed == {(e, t) for e in (FWD_START, FWD_END, BWD_START, BWD_END) for t in range(3)}
    assert {(e, t) for e, c, k, t in seen if c != slow} == {(FWD_START, 0), (FWD_END, 0)}
    assert len(slept) == 2 * 3  # forward and backward of each of its micro-batches
