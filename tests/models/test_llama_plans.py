"""`rh.models.Llama` with its tensor parallelism left to the shardings ("auto": XLA inserts
the collectives) computes its own single-device loss and gradients under every plan with
tp > 1 of the equivalence test (tests/step/test_train_equivalence.py, which holds the
model's own "manual" mode, a preset's, to a plain jit of it), at the same tolerances.
Plans that differ only in their splits share one compiled program, as a re-plan does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import resihp_jax as rh
from resihp_jax.attention import kernels
from resihp_jax.meshes import layout
from resihp_jax.plan import Plan
from resihp_jax.nn.layers import next_token_targets
from resihp_jax.step.config import StepConfig
from resihp_jax.step.model_parts import split_model
from resihp_jax.step.body import token_nll_sum
from resihp_jax.step.program import abstract_args
from resihp_jax.step.builder import build_model_step
from tests.helpers import make_batches, max_relative_error
from tests.step.test_train_equivalence import PLANS, _same_mesh_groups

M, B, S = 8, 2, 64


def _reference(model: rh.models.Llama, batch) -> tuple[float, dict]:
    """The model's own loss and gradients on one device (every micro-batch at once)."""
    flat = [jnp.asarray(a.reshape(-1, S)) for a in
            (batch.tokens_MxBxS, batch.segment_ids_MxBxS, batch.positions_MxBxS)]

    def mean_loss(m: rh.models.Llama) -> jax.Array:
        targets, weights = next_token_targets(flat[0], flat[1])
        return token_nll_sum(m(*flat), targets, weights) / jnp.maximum(weights.sum(), 1)

    loss, grads = nnx.jit(nnx.value_and_grad(mean_loss))(model)
    return float(loss), nnx.to_pure_dict(grads)


class AutoLlama(rh.models.Llama):
    """The same model with its tensor parallelism left to the shardings (XLA's)."""

    tensor_parallel = "auto"


def _cases() -> list[object]:
    groups = _same_mesh_groups()
    return [pytest.param(g, "auto", id="auto " + " + ".join(g)) for g in groups
            if PLANS[g[0]].tp > 1]


@pytest.fixture(scope="module")
def case():
    model = rh.models.Llama(rh.engine.get_model_config("tiny"), rngs=nnx.Rngs(0))
    batch = make_batches(M, B, S)[0]
    loss, grads = _reference(model, batch)
    return model, batch, loss, grads


def _as(model: rh.models.Llama, mode: str) -> rh.models.Llama:
    if mode == "manual":
        return model
    auto = nnx.eval_shape(lambda: AutoLlama("tiny", rngs=nnx.Rngs(0)))
    nnx.update(auto, nnx.state(model))
    return auto


@pytest.mark.parametrize("names,mode", _cases())
def test_every_plan_computes_the_models_own_loss_and_gradients(names, mode, case) -> None:
    model, batch, want_loss, want = case
    plans = [PLANS[n] for n in names]
    parts, shell, blocks = split_model(_as(model, mode))
    assert parts.tensor_parallel == mode
    params = {"shell": shell, "blocks": blocks}
    train = StepConfig(layer_slots=max(max(p.layers_per_stage) for p in plans),
                        microbatch_slots=max(max(p.microbatches_per_group) for p in plans))
    program = build_model_step(parts, optax.sgd(0.1), plans[0], jax.devices(), params,
                              train=train)
    want_blocks = want["blocks"]
    stacked = [np.stack(x) for x in zip(*(jax.tree.leaves(want_blocks[i])
                                          for i in range(len(want_blocks))))]
    want_shell = {k: v for k, v in want.items() if k != "blocks"}
    for name, plan in zip(names, plans):
        replanned = program.with_plan(plan)  # same compiled program, new splits
        state = replanned.init_state(params)
        loss, grads = replanned.loss_and_grads(state.params, replanned.shard_batch(
            batch.tokens_MxBxS, batch.segment_ids_MxBxS, batch.positions_MxBxS))
        grads = jax.device_get(layout.to_canonical_layout(grads,
                                                          replanned.canonical_positions()))
        np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, err_msg=name)
        got_blocks = jax.tree.leaves(grads["blocks"])
        assert max_relative_error(got_blocks, stacked) < 1e-4, name
        assert max_relative_error(jax.tree.leaves(grads["shell"]),
                                  jax.tree.leaves(want_shell)) < 1e-4, name


@pytest.mark.parametrize("mode", ["manual", "auto"])
def test_only_the_manual_model_leaves_no_axis_to_the_partitioner_around_its_attention(
        mode, case, monkeypatch) -> None:
    """At tp = 2 the manual model's attention is traced with every mesh axis manual: "auto"
    picks the fused kernels there on a GPU (a Triton or cuDNN call XLA cannot split); the
    model that leaves 'tp' to XLA keeps the block-sparse scan."""
    seen: list[tuple[str, ...]] = []  # what "auto" weighs at each of the model's calls
    real = kernels.resolve_implementation

    def resolve(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(kernels._auto_mesh_axes())
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "resolve_implementation", resolve)
    model = case[0]
    parts, shell, blocks = split_model(_as(model, mode))
    plan = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=4, microbatch_size=2, seq_len=S)
    program = build_model_step(parts, optax.sgd(0.1), plan, jax.devices(),
                              {"shell": shell, "blocks": blocks})
    program.step_fn.lower(*abstract_args(program))  # traced, not compiled
    assert seen and set(seen) == ({()} if mode == "manual" else {("tp",)}), seen
