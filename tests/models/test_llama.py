"""`rh.models.Llama`, the built-in Llama written as a plain NNX model: on the same parameters
it computes the built-in decoder's logits, loss and gradients, and `rh.fit` trains it to the
built-in step's losses and weights under an uneven 2/2/2 plan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import resihp_jax as rh
from resihp_jax.model import decoder, layers
from resihp_jax.models.llama import from_builtin, pure_params_to_builtin, to_builtin
from resihp_jax.train.config import TrainConfig
from resihp_jax.train.step import build_step
from resihp_jax.train.user_pipeline import token_nll_sum
from tests.helpers import make_batches, max_relative_error

SEQ, MB_SIZE, N_MB, STEPS, SEED = 32, 2, 4, 3, 7


def _packed_rows() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two rows of 64: documents of 20, 30 and 10 tokens and 4 padding; 64 tokens in one."""
    tokens = np.random.default_rng(0).integers(0, 256, (2, 64)).astype(np.int32)
    seg = np.stack([np.repeat([1, 2, 3, 0], [20, 30, 10, 4]), np.ones(64, int)])
    pos = np.stack([np.concatenate([np.arange(20), np.arange(30), np.arange(10),
                                    np.zeros(4, int)]), np.arange(64)])
    return tokens, seg.astype(np.int32), pos.astype(np.int32)


def test_parameters_carry_the_logical_names_the_default_rules_shard() -> None:
    with nnx.use_eager_sharding(False):
        model = rh.models.Llama(rh.engine.get_model_config("tiny"), rngs=nnx.Rngs(0))
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param)))
    block = specs["blocks"][0]
    assert tuple(specs["table"]) == ("vocab", "embed")
    assert tuple(specs["lm_head"]) == ("embed", "vocab")
    assert tuple(block["wq"])[:2] == ("embed", "heads")
    assert tuple(block["wk"])[:2] == tuple(block["wv"])[:2] == ("embed", "kv")
    assert tuple(block["wo"])[::2] == ("heads", "embed")
    assert tuple(block["w_up"]) == tuple(block["w_gate"]) == ("embed", "mlp")
    assert tuple(block["w_down"]) == ("mlp", "embed")
    assert sum(x.size for x in jax.tree.leaves(to_builtin(model))) == \
        model.config.param_count()


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
def test_logits_loss_and_gradients_equal_the_builtin_decoders(preset: str) -> None:
    cfg = rh.engine.get_model_config(preset)
    params = decoder.init_params(cfg, SEED)
    model = from_builtin(cfg, params)
    tokens, seg, pos = _packed_rows()
    targets, weights = layers.next_token_targets(jnp.asarray(tokens), jnp.asarray(seg))

    @nnx.jit
    def nnx_loss_and_grads(m: rh.models.Llama):
        def loss(m_: rh.models.Llama) -> tuple[jax.Array, jax.Array]:
            logits = m_(tokens, seg, pos)
            return token_nll_sum(logits, targets, weights), logits  # the generic step's loss

        return nnx.value_and_grad(loss, has_aux=True)(m)

    @jax.jit
    def builtin_loss_and_grads(p: dict):
        def loss(p_: dict) -> tuple[jax.Array, jax.Array]:
            logits = decoder.forward_logits(p_, tokens, seg, pos, cfg)
            return layers.token_loss_sum(logits, targets, weights), logits

        return jax.value_and_grad(loss, has_aux=True)(p)

    (loss, logits), grads = nnx_loss_and_grads(model)
    (want_loss, want_logits), want_grads = builtin_loss_and_grads(params)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    got_grads = pure_params_to_builtin(nnx.to_pure_dict(grads))
    assert max_relative_error(got_grads, want_grads) < 1e-4
    # and back: the converted model holds exactly the parameters it was given
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, to_builtin(model), params)))


def _plan() -> rh.Plan:
    return rh.Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=N_MB, microbatch_size=MB_SIZE,
                           seq_len=SEQ).replace(layers_per_stage=(1, 3),
                                                microbatches_per_group=(3, 1))


def _builtin_run(cfg: rh.engine.ModelConfig, train: TrainConfig,
                 batches) -> tuple[list[float], dict]:
    """The built-in path: `build_step` (hand-written Megatron collectives) from `SEED`."""
    program = build_step(cfg, train, _plan(), jax.devices())
    state = program.init_state(SEED)
    losses = []
    for b in batches:
        state, metrics = program.step(state, program.shard_batch(
            b.tokens_MxBxS, b.segment_ids_MxBxS, b.positions_MxBxS))
        losses.append(float(metrics["loss"]))
    canonical = program.to_canonical_fn(state, program.canonical_positions())
    return losses, jax.device_get(canonical.params)


def test_fit_trains_it_to_the_builtin_steps_losses_and_weights() -> None:
    cfg, train = rh.engine.get_model_config("tiny-gqa"), TrainConfig()
    batches = make_batches(N_MB, MB_SIZE, SEQ, n_batches=STEPS, seed=3)
    want_losses, want_params = _builtin_run(cfg, train, batches)
    model = from_builtin(cfg, decoder.init_params(cfg, SEED))  # the same initial weights
    data = [rh.PackedBatch(*(a.reshape(-1, SEQ) for a in (
        b.tokens_MxBxS, b.segment_ids_MxBxS, b.positions_MxBxS))) for b in batches]
    # the built-in step's own optimizer (AdamW with warm-up and clipping), applied as given
    result = rh.fit(model, data, optimizer=train.optimizer(), plan=_plan(), steps=STEPS,
                    progress=False)
    np.testing.assert_allclose(list(result.losses.values()), want_losses, rtol=1e-5)
    assert type(result.model) is rh.models.Llama
    assert result.facts.attention_cost == "document"  # it calls our segment attention
    # looser than the losses: Adam moves an element whose gradient is at rounding level by up
    # to its learning rate either way (seen: 7e-6 on one w_down element, 4e-3 of its move)
    assert max_relative_error(to_builtin(result.model), want_params) < 1e-3


def test_it_computes_in_bf16_from_the_config_or_from_weights_the_step_cast() -> None:
    cfg = rh.engine.get_model_config("tiny", dtype="bfloat16")
    params = decoder.init_params(cfg, SEED)
    tokens, seg, pos = _packed_rows()
    want = jax.jit(lambda p: decoder.forward_logits(p, tokens, seg, pos, cfg))(params)
    got = nnx.jit(lambda m: m(tokens, seg, pos))(from_builtin(cfg, params))
    assert got.dtype == want.dtype == jnp.float32  # logits stay float32 either way
    # bf16 rounding of differently fused ops: a few bf16 ulps of the largest logit
    np.testing.assert_allclose(got, want, atol=4 * 2**-8 * float(jnp.abs(want).max()))
    # a float32 config handed bf16 copies (rh.fit(compute_dtype='bfloat16')) stays in bf16
    bf16_copy = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    model = from_builtin(cfg.replace(dtype="float32"), bf16_copy)
    h = nnx.jit(lambda m: m.blocks[0](m.embed(tokens, pos), seg, pos))(model)
    assert h.dtype == jnp.bfloat16


def test_fit_trains_a_model_whose_attention_takes_only_blocks_of_128() -> None:
    """The facts of a user's model are read off rows its blocks accept: blocks of 128 refuse
    the short probe rows (64), so they are read at half and all of the training rows' length
    (this failed every `rh.fit` of a preset with blocks of 128 before, llama-1b's too)."""
    cfg = rh.engine.get_model_config("tiny", attn_block=128)
    seq = 256
    batches = make_batches(1, 2, seq, n_batches=2, seed=3)
    data = [rh.PackedBatch(*(a.reshape(-1, seq) for a in (
        b.tokens_MxBxS, b.segment_ids_MxBxS, b.positions_MxBxS))) for b in batches]
    plan = rh.Plan.uniform(1, 1, 1, n_layers=cfg.n_layers, n_microbatches=1,
                           microbatch_size=2, seq_len=seq)
    result = rh.fit(lambda rngs: rh.models.Llama(cfg, rngs=rngs), data,
                    optimizer=TrainConfig().optimizer(), plan=plan, steps=2, progress=False)
    assert all(np.isfinite(list(result.losses.values())))
    # against the same model at blocks of 16, read at 64 and 128 tokens: the same weights;
    # more FLOPs per token (the kernel computes whole diagonal blocks of 128)
    small = rh.fit(lambda rngs: rh.models.Llama(cfg.replace(attn_block=16), rngs=rngs), data,
                   optimizer=TrainConfig().optimizer(), plan=plan, steps=1, progress=False)
    assert result.facts.layer_params == small.facts.layer_params
    assert result.facts.layer_flops > small.facts.layer_flops
