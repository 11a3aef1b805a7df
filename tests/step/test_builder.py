"""A user's NNX model's step under any plan: the loss and every parameter's gradient equal the
model's own single-device values (tensor parallelism from the shardings, no user collectives)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from resihp_jax.meshes import layout
from resihp_jax.plan import Plan
from resihp_jax.nn.layers import next_token_targets
from resihp_jax.step.model_parts import split_model
from resihp_jax.step.body import token_nll_sum
from resihp_jax.step.builder import build_model_step
from tests.helpers import make_batches
from tests.step.user_models import make_gpt2

SEQ = 32


def _reference(model, batch) -> tuple[float, dict]:
    flat = [jnp.asarray(a.reshape(-1, SEQ)) for a in
            (batch.tokens_MxBxS, batch.segment_ids_MxBxS, batch.positions_MxBxS)]

    def mean_loss(m):
        targets, weights = next_token_targets(flat[0], flat[1])
        return token_nll_sum(m(*flat), targets, weights) / jnp.maximum(weights.sum(), 1)

    loss, grads = nnx.value_and_grad(mean_loss)(model)
    return float(loss), nnx.to_pure_dict(grads)


# 1/1/1 and 2/2/2 uneven: through rh.fit, trained against a plain loop, in the zoo
# (tests/models/test_zoo.py) and tests/runtime/run/test_fit.py
@pytest.mark.parametrize("mesh, layers, mbs", [
    ((1, 4, 2), (1, 1, 1, 1), (4,)),
    ((1, 1, 4), (4,), (4,))])  # tp alone: no manual axis with more than one device
def test_loss_and_every_gradient_equal_the_models_own(mesh, layers, mbs) -> None:
    model = make_gpt2()
    parts, shell, blocks = split_model(model)
    params = {"shell": shell, "blocks": blocks}
    plan = Plan.uniform(*mesh, n_layers=4, n_microbatches=4, microbatch_size=2,
                        seq_len=SEQ).replace(layers_per_stage=layers, microbatches_per_group=mbs)
    program = build_model_step(parts, optax.sgd(0.1), plan, jax.devices(), params)
    batch = make_batches(4, 2, SEQ, seed=5)[0]
    state = program.init_state(params)
    loss, grads = program.loss_and_grads(state.params, program.shard_batch(
        batch.tokens_MxBxS, batch.segment_ids_MxBxS, batch.positions_MxBxS))
    grads = jax.device_get(layout.to_canonical_layout(grads, program.canonical_positions()))
    want_loss, want = _reference(model, batch)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    got = {"blocks": grads["blocks"], **grads["shell"]}
    want_blocks = want.pop("blocks")
    stacked = [np.stack(x) for x in zip(*(jax.tree.leaves(want_blocks[i]) for i in range(4)))]
    for a, b in zip(jax.tree.leaves(got["blocks"]), stacked, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)  # each block's gradient
    for key, value in want.items():
        for a, b in zip(jax.tree.leaves(got[key]), jax.tree.leaves(value)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=key)
    # tensor parallelism came from the shardings: a 'mlp' kernel is split over tp
    up = state.params["blocks"]["up"]["kernel"]
    assert up.sharding.spec[-1] == "tp" and up.addressable_shards[0].data.shape[-1] == \
        up.shape[-1] // mesh[2]
