"""`rh.models.Llama`, the Llama `resihp train` and the demo train: its parameters' logical
names and count, documents that never see each other, bf16 compute, and `rh.fit` training it
under an uneven 2/2/2 plan to a plain jit loop's losses and weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import resihp_jax as rh
from resihp_jax.models.optimizer import AdamWConfig
from resihp_jax.step.model_parts import split_model
from tests.helpers import llama_loss_sum, llama_params, make_batches, max_relative_error

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
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == \
        model.config.param_count()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_documents_never_see_each_other_or_the_future(dtype: str) -> None:
    model = rh.models.Llama(rh.engine.get_model_config("tiny-gqa", dtype=dtype),
                            rngs=nnx.Rngs(0))
    tokens, seg, pos = _packed_rows()
    forward = nnx.jit(lambda m, t: m(t, seg, pos))
    base = forward(model, tokens)
    changed = tokens.copy()
    changed[0, 10:20] = (changed[0, 10:20] + 1) % 256  # second half of document 1
    diff = np.abs(np.asarray(forward(model, changed) - base)).max(axis=-1)[0]
    assert diff[:10].max() == 0.0  # its past is untouched (causal)
    assert diff[10:20].min() > 0.0
    assert diff[20:].max() == 0.0  # other documents are untouched (segment isolation)


def _plan() -> rh.Plan:
    return rh.Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=N_MB, microbatch_size=MB_SIZE,
                           seq_len=SEQ).replace(layers_per_stage=(1, 3),
                                                microbatches_per_group=(3, 1))


def _plain_loop(cfg: rh.engine.ModelConfig, optimizer: optax.GradientTransformation,
                batches) -> tuple[list[float], dict]:
    """A plain jit loop of the same model from `SEED` on whole weights: each step the
    token-weighted mean loss of the whole batch, the optimizer's update."""
    loss_sum = llama_loss_sum(cfg)

    @jax.jit
    def step(params, opt_state, tokens, seg, pos):
        def mean(p):
            total, count = loss_sum(p, tokens, seg, pos)
            return total / count
        loss, grads = jax.value_and_grad(mean)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = llama_params(cfg, SEED)
    opt_state, losses = optimizer.init(params), []
    for b in batches:
        params, opt_state, loss = step(params, opt_state, *(a.reshape(-1, SEQ) for a in (
            b.tokens_MxBxS, b.segment_ids_MxBxS, b.positions_MxBxS)))
        losses.append(float(loss))
    return losses, jax.device_get(params)


def test_fit_trains_it_to_a_plain_loops_losses_and_weights() -> None:
    cfg, adamw = rh.engine.get_model_config("tiny-gqa"), AdamWConfig()
    batches = make_batches(N_MB, MB_SIZE, SEQ, n_batches=STEPS, seed=3)
    want_losses, want_params = _plain_loop(cfg, adamw.optimizer(), batches)
    data = [rh.PackedBatch(*(a.reshape(-1, SEQ) for a in (
        b.tokens_MxBxS, b.segment_ids_MxBxS, b.positions_MxBxS))) for b in batches]
    # `resihp train`'s optimizer (AdamW with warm-up and clipping), applied as given
    result = rh.fit(lambda rngs: rh.models.Llama(cfg, rngs=rngs), data,
                    optimizer=adamw.optimizer(), plan=_plan(), steps=STEPS, seed=SEED,
                    progress=False)
    np.testing.assert_allclose(list(result.losses.values()), want_losses, rtol=1e-5)
    assert type(result.model) is rh.models.Llama
    assert result.facts.attention_cost == "document"  # it calls our segment attention
    # looser than the losses: Adam moves an element whose gradient is at rounding level by up
    # to its learning rate either way (seen: 7e-6 on one w_down element, 4e-3 of its move)
    _, shell, blocks = split_model(result.model)
    assert max_relative_error({"shell": shell, "blocks": blocks}, want_params) < 1e-3


def test_it_computes_in_bf16_from_the_config_or_from_weights_the_step_cast() -> None:
    cfg = rh.engine.get_model_config("tiny")
    tokens, seg, pos = _packed_rows()
    forward = nnx.jit(lambda m: m(tokens, seg, pos))
    want = forward(rh.models.Llama(cfg, rngs=nnx.Rngs(SEED)))
    bf16 = rh.models.Llama(cfg.replace(dtype="bfloat16"), rngs=nnx.Rngs(SEED))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(bf16, nnx.Param)))
    got = forward(bf16)
    assert got.dtype == want.dtype == jnp.float32  # logits stay float32 either way
    # a few bf16 roundings (2**-9 relative each) through the layers: 2% of the largest logit
    np.testing.assert_allclose(got, want, atol=2e-2 * float(jnp.abs(want).max()))
    assert not np.array_equal(got, want)  # computed in bf16, not silently in float32
    # a float32 config handed bf16 copies (rh.fit(compute_dtype='bfloat16')) stays in bf16
    model = rh.models.Llama(cfg, rngs=nnx.Rngs(SEED))
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), state))
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
                    optimizer=AdamWConfig().optimizer(), plan=plan, steps=2, progress=False)
    assert all(np.isfinite(list(result.losses.values())))
    # against the same model at blocks of 16, read at 64 and 128 tokens: the same weights;
    # more FLOPs per token (the kernel computes whole diagonal blocks of 128)
    small = rh.fit(lambda rngs: rh.models.Llama(cfg.replace(attn_block=16), rngs=rngs), data,
                   optimizer=AdamWConfig().optimizer(), plan=plan, steps=1, progress=False)
    assert result.facts.layer_params == small.facts.layer_params
    assert result.facts.layer_flops > small.facts.layer_flops
