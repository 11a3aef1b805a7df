"""bf16 compute with float32 masters: what stays float32, what runs in bf16, and a few bf16
steps of 2/2/2 train like float32 (per-plan loss and gradient checks: test_train_equivalence)."""

from __future__ import annotations

from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jex_core

from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.perfmodel import memory_bytes_per_device
from resihp_jax.perfmodel.memory import static_bytes_S
from resihp_jax.perfmodel.work import stage_param_counts
from resihp_jax.step.config import StepConfig
from tests.helpers import llama_step
from tests.helpers import make_batches

M, B, S, STEPS = 8, 2, 64, 4
PLAN = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=M, microbatch_size=B, seq_len=S)


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    """Each dtype trained STEPS steps on one repeated batch (so its loss must fall)."""
    batch = make_batches(M, B, S)[0]
    out = {}
    for dtype in ("float32", "bfloat16"):
        program = llama_step(get_model_config("tiny", dtype=dtype), StepConfig(), PLAN,
                             jax.devices())
        sharded = program.shard_batch(batch.tokens_MxBxS, batch.segment_ids_MxBxS,
                                      batch.positions_MxBxS)
        state = program.init_state(0)
        init = jax.device_get(state.params)  # a host copy: the step donates `state`
        losses = []
        for _ in range(STEPS):
            state, metrics = program.step(state, sharded)
            losses.append(float(metrics["loss"]))
        out[dtype] = dict(program=program, batch=sharded, state=state, losses=np.array(losses),
                          init=init)
    return out


def test_bf16_steps_give_finite_falling_losses_close_to_float32(runs) -> None:
    bf16, f32 = runs["bfloat16"]["losses"], runs["float32"]["losses"]
    assert np.isfinite(bf16).all()
    assert (np.diff(bf16) < 0).all(), bf16
    # The loss is a float32 mean over ~1,000 tokens from float32 logits: its bf16 error stays
    # far below one bf16 rounding (2**-9 ~ 2e-3) of the loss, even after a few updates.
    np.testing.assert_allclose(bf16, f32, rtol=2e-3)
    assert not np.array_equal(bf16, f32)  # the bf16 run did compute in bf16


def test_bf16_state_keeps_float32_masters_and_moments(runs) -> None:
    state, init = runs["bfloat16"]["state"], runs["bfloat16"]["init"]
    leaves = jax.tree.leaves(state.params)
    assert leaves and all(x.dtype == jnp.float32 for x in leaves)
    for moment in ("mu", "nu"):
        tree = optax.tree_utils.tree_get(state.opt_state, moment)
        assert jax.tree.structure(tree) == jax.tree.structure(state.params)
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(tree))
        assert all(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(tree))
    # Updates far smaller than a bf16 ulp of the weights still land in the float32 masters.
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state.params, init)
    assert all(d > 0 for d in jax.tree.leaves(moved))


def _dot_operand_dtypes(jaxpr: jex_core.Jaxpr) -> Iterator[tuple[str, ...]]:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield tuple(str(v.aval.dtype) for v in eqn.invars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                if isinstance(sub, jex_core.ClosedJaxpr):
                    yield from _dot_operand_dtypes(sub.jaxpr)
                elif isinstance(sub, jex_core.Jaxpr):
                    yield from _dot_operand_dtypes(sub)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_matmul_of_the_step_runs_in_the_compute_dtype(runs, dtype: str) -> None:
    """Forward and backward, layers, attention and head: a float32 operand in a bf16 step
    would promote that matmul to float32 (the head's backward did, before its custom VJP)."""
    run = runs[dtype]
    jaxpr = jax.make_jaxpr(run["program"].loss_and_grads_fn)(
        run["state"].params, run["batch"], run["program"].splits())
    operands = set(_dot_operand_dtypes(jaxpr.jaxpr))
    assert operands == {(dtype, dtype)}


def test_memory_model_keeps_float32_state_under_bf16_compute() -> None:
    """bf16 halves activations but not the state: masters, grads and both Adam moments stay
    float32 (16 bytes a parameter), plus the step's bf16 copy of layer and head weights."""
    plan = Plan.uniform(2, 2, 2, n_layers=32, n_microbatches=8, microbatch_size=1,
                        seq_len=4096)
    f32, bf16 = (get_model_config("llama2-7b", dtype=d) for d in ("float32", "bfloat16"))
    params_S = stage_param_counts(plan, f32) / plan.tp
    np.testing.assert_allclose(static_bytes_S(plan, f32, None), 16 * params_S)
    copy_S = static_bytes_S(plan, bf16, None) - static_bytes_S(plan, f32, None)
    embed = bf16.vocab_size * bf16.d_model / plan.tp
    np.testing.assert_allclose(copy_S, 2 * (params_S - np.array([embed, 0.0])))
    assert (memory_bytes_per_device(plan, bf16) < memory_bytes_per_device(plan, f32)).all()
