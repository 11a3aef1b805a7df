"""The zoo (tests/models/zoo.py): each user model, written in an idiom of its own, trains
under `rh.fit` at 1/1/1, at 2/2/2 with uneven layers and micro-batches, and at dp=8 to what a
plain `jax.jit` loop of the same model and optimizer gives on the same batches (dropout: the
same under every plan), or is refused before its first step in one line naming the
construct. None hangs."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import resihp_jax as rh
from resihp_jax.errors import ConfigError
from resihp_jax.nn.layers import next_token_targets
from resihp_jax.step.body import token_nll_sum
from tests.helpers import make_batches
from tests.models import zoo

SEQ, ROWS, STEPS, LR = 32, 8, 2, 0.1
PLANS = {  # (dp, pp, tp), layers per stage, micro-batches per group, micro-batch size
    "1/1/1": ((1, 1, 1), (4,), (4,), 2),
    "2/2/2 uneven": ((2, 2, 2), (1, 3), (3, 1), 2),
    "8/1/1": ((8, 1, 1), (4,), (1,) * 8, 1),
}
TRAINED = [name for name in zoo.ZOO if name != "dropout"]
# bfloat16 parameters: the loop and the pipeline round differently (one bf16 ulp, 2^-8)
TOLERANCE = {"bfloat16 parameters": (4e-3, 2e-2)}
# the math is under test, not the re-plans: nothing compiled ahead for them
QUIET = rh.ResilienceConfig(precompile=0, background_compile=False)


def _batches() -> list[rh.PackedBatch]:
    return [rh.PackedBatch(*(a.reshape(-1, SEQ) for a in (
        b.tokens_MxBxS, b.segment_ids_MxBxS, b.positions_MxBxS)))
        for b in make_batches(4, ROWS // 4, SEQ, n_batches=STEPS, seed=7)]


def _plan(name: str) -> rh.Plan:
    (dp, pp, tp), layers, groups, mb_size = PLANS[name]
    return rh.Plan.uniform(dp, pp, tp, n_layers=zoo.LAYERS, n_microbatches=ROWS // mb_size,
                           microbatch_size=mb_size, seq_len=SEQ).replace(
        layers_per_stage=layers, microbatches_per_group=groups)


def _mean_loss(model, tokens, seg, pos) -> jax.Array:
    targets, weights = next_token_targets(tokens, seg)
    return token_nll_sum(model(tokens, seg, pos), targets, weights) / jnp.maximum(weights.sum(), 1)


def _params(model: nnx.Module) -> dict:
    return jax.tree.map(lambda x: np.asarray(x, np.float32),
                        nnx.to_pure_dict(nnx.state(model, nnx.Param)))


@pytest.fixture(scope="module", params=TRAINED)
def plain(request) -> tuple[str, list[float], dict]:
    """The user's own loop: one jitted step on one device, no pipeline."""
    model = zoo.make(request.param)
    opt = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, tokens, seg, pos):
        loss, grads = nnx.value_and_grad(_mean_loss)(model, tokens, seg, pos)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, *map(jnp.asarray, b))) for b in _batches()]
    return request.param, losses, _params(model)


@pytest.mark.parametrize("plan", list(PLANS))
def test_each_model_trains_as_its_plain_loop(plan: str, plain) -> None:
    name, losses, want = plain
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = rh.fit(zoo.make(name), _batches(), optimizer=optax.sgd(LR), plan=_plan(plan),
                        steps=STEPS, progress=False, resilience=QUIET)
    loss_tol, param_tol = TOLERANCE.get(name, (1e-5, 1e-4))
    np.testing.assert_allclose(list(result.losses.values()), losses, rtol=loss_tol)
    got = _params(result.model)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                            jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=param_tol, atol=param_tol / 10,
                                   err_msg=f"{name} {plan} {jax.tree_util.keystr(path)}")
    selected = [w for w in caught if type(w.message).__name__ == "SelectedGatesWarning"]
    # only the split of a fused projection across tp shards needs gates by selection
    assert bool(selected) == (name == "fused qkv jnp.split" and plan == "2/2/2 uneven")


def test_dropout_draws_fresh_masks_that_every_plan_draws_alike() -> None:
    """Dropout trains (its masks drawn from the model's own stream, folded with the step, the
    layer and the micro-batch), reproducibly: 2/2/2 uneven, a re-plan's kind of change,
    trains to what 1/1/1 does, to the loop's tolerances."""
    runs = {plan: rh.fit(zoo.make("dropout"), _batches(), optimizer=optax.sgd(LR),
                         plan=_plan(plan), steps=STEPS, progress=False)
            for plan in ("1/1/1", "2/2/2 uneven")}
    (a, b) = runs.values()
    np.testing.assert_allclose(list(b.losses.values()), list(a.losses.values()), rtol=1e-5)
    for x, y in zip(jax.tree.leaves(_params(b.model)), jax.tree.leaves(_params(a.model)),
                    strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
    # the masks are real: the first step's loss is not the model's loss without dropout
    model = zoo.make("dropout")
    first = _batches()[0]
    quiet = float(nnx.jit(_mean_loss)(nnx.view(model, deterministic=True),
                                      *map(jnp.asarray, first)))
    assert abs(a.losses[1] - quiet) > 1e-3
    assert a.losses[2] < a.losses[1]
    # the trained model's blocks keep streams of their own, as the user's had
    streams = [block.drop.rngs for block in a.model.blocks]
    assert len({id(s.count) for s in streams}) == len({str(s.key.get_value()) for s in streams}) \
        == zoo.LAYERS


def test_a_dropout_without_a_stream_is_refused_in_one_line() -> None:
    model = zoo.make("dropout")
    for block in model.blocks:
        block.drop = nnx.Dropout(0.1)
    with pytest.raises(ConfigError, match=r"blocks\.0\.drop is a Dropout with rate 0\.1 and no "
                       r"rngs") as err:
        rh.fit(model, _batches(), optimizer=optax.sgd(LR), plan=_plan("1/1/1"), steps=1,
               progress=False)
    assert "\n" not in str(err.value)
