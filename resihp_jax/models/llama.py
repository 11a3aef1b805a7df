"""Llama as a plain Flax NNX model behind the user's-model contract (docs/DESIGN.md).

Its tensor parallelism is manual (`tensor_parallel = "manual"`): under tp > 1 each block
sees its own heads and MLP columns and sums them with `rh.nn.tp_sum`, the embedding is
vocab-parallel and the head returns this device's vocabulary slice, so its step is manual
over every mesh axis (stage timing, injected slowdowns and fused kernels reach it at any tp).
It computes in `config.dtype` from float32 masters cast at use (nn/layers.py holds the math).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from resihp_jax.models.config import ModelConfig, get_model_config
from resihp_jax.nn import layers, segment_attention, tp_sum, vocab_embed


def _param(value: jax.Array, names: tuple[str, ...]) -> nnx.Param:
    # Logical names only: the train step shards from them, nothing is placed at creation.
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float,
            names: tuple[str, ...]) -> nnx.Param:
    return _param(std * jax.random.normal(rngs.params(), shape, jnp.float32), names)


def _compute(x: jax.Array, dtype: str) -> jax.Array:
    """`x` in the compute dtype: float32 masters are cast to the config's `dtype`; a copy the
    step already cast lower (`rh.fit(..., compute_dtype='bfloat16')`) stays as it is, so
    either knob gives bf16 compute."""
    if jnp.finfo(x.dtype).bits < jnp.finfo(dtype).bits:
        return x
    return x.astype(dtype)


def _cast(w: nnx.Param, dtype: str) -> jax.Array:
    return _compute(w[...], dtype)


class RMSNorm(nnx.Module):
    def __init__(self, d: int, eps: float, dtype: str) -> None:
        self.eps, self.dtype = eps, dtype
        self.scale = _param(jnp.ones((d,), jnp.float32), ("embed",))

    def __call__(self, x_BxSxD: jax.Array) -> jax.Array:
        return layers.rms_norm(x_BxSxD, _cast(self.scale, self.dtype), self.eps)


class LlamaBlock(nnx.Module):
    """One pre-norm decoder layer: grouped-KV attention with rotary positions, then SwiGLU."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, attention: str = "auto") -> None:
        d, h, g, k, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
        std = d ** -0.5
        # the built-in's init: output projections scaled down with depth, so the residual
        # stream's scale stays flat however many layers there are
        depth = (2 * cfg.n_layers) ** -0.5
        self.cfg, self.attention_kernel = cfg, attention
        self.attn_norm = RMSNorm(d, cfg.norm_eps, cfg.dtype)
        self.wq = _normal(rngs, (d, h, k), std, ("embed", "heads", "head_dim"))
        self.wk = _normal(rngs, (d, g, k), std, ("embed", "kv", "head_dim"))
        self.wv = _normal(rngs, (d, g, k), std, ("embed", "kv", "head_dim"))
        self.wo = _normal(rngs, (h, k, d), std * depth, ("heads", "head_dim", "embed"))
        self.mlp_norm = RMSNorm(d, cfg.norm_eps, cfg.dtype)
        self.w_gate = _normal(rngs, (d, f), std, ("embed", "mlp"))
        self.w_up = _normal(rngs, (d, f), std, ("embed", "mlp"))
        self.w_down = _normal(rngs, (f, d), f ** -0.5 * depth, ("mlp", "embed"))

    def attention(self, x_BxSxD: jax.Array, seg_BxS: jax.Array,
                  pos_BxS: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.cfg.dtype
        h_BxSxD = self.attn_norm(x_BxSxD)
        q_BxSxHxK = layers.rotary(jnp.einsum("bsd,dhk->bshk", h_BxSxD, _cast(self.wq, dt)),
                                  pos_BxS, cfg.rope_theta)
        k_BxSxGxK = layers.rotary(jnp.einsum("bsd,dgk->bsgk", h_BxSxD, _cast(self.wk, dt)),
                                  pos_BxS, cfg.rope_theta)
        v_BxSxGxK = jnp.einsum("bsd,dgk->bsgk", h_BxSxD, _cast(self.wv, dt))
        o_BxSxHxK = checkpoint_name(segment_attention(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS,
                                                      block_size=cfg.attn_block,
                                                      implementation=self.attention_kernel),
                                    layers.CONTEXT)
        return jnp.einsum("bshk,hkd->bsd", o_BxSxHxK, _cast(self.wo, dt))

    def mlp(self, x_BxSxD: jax.Array) -> jax.Array:
        dt = self.cfg.dtype
        h_BxSxD = self.mlp_norm(x_BxSxD)
        gate_BxSxF = jnp.einsum("bsd,df->bsf", h_BxSxD, _cast(self.w_gate, dt))
        up_BxSxF = jnp.einsum("bsd,df->bsf", h_BxSxD, _cast(self.w_up, dt))
        return jnp.einsum("bsf,fd->bsd", jax.nn.silu(gate_BxSxF) * up_BxSxF,
                          _cast(self.w_down, dt))

    def __call__(self, x_BxSxD: jax.Array, seg_BxS: jax.Array,
                 pos_BxS: jax.Array) -> jax.Array:
        # each projection back to d_model is over this device's heads / columns: summed
        x_BxSxD = x_BxSxD + tp_sum(self.attention(x_BxSxD, seg_BxS, pos_BxS))
        return x_BxSxD + tp_sum(self.mlp(x_BxSxD))


class Llama(nnx.Module):
    """Llama-style decoder for `config`: a `ModelConfig` (`rh.models.get_model_config('tiny')`)
    or a preset's name ('tiny'). `attention`: the kernel of `rh.nn.segment_attention`
    ("auto": the fastest correct one for the device; see its `implementation`)."""

    tensor_parallel = "manual"  # (module docstring)

    def __init__(self, config: ModelConfig | str, *, rngs: nnx.Rngs,
                 attention: str = "auto") -> None:
        if isinstance(config, str):
            config = get_model_config(config)
        d, v = config.d_model, config.vocab_size
        self.config = config
        self.table = _normal(rngs, (v, d), 1.0, ("vocab", "embed"))
        self.blocks = nnx.List([LlamaBlock(config, rngs=rngs, attention=attention)
                                for _ in range(config.n_layers)])
        self.final_norm = RMSNorm(d, config.norm_eps, config.dtype)
        self.lm_head = _normal(rngs, (d, v), d ** -0.5, ("embed", "vocab"))

    def embed(self, tokens_BxS: jax.Array, positions_BxS: jax.Array) -> jax.Array:
        del positions_BxS  # positions enter through the blocks' rotary embedding
        # gather float32 rows, then cast only those (the built-in's order)
        return _compute(vocab_embed(self.table[...], tokens_BxS), self.config.dtype)

    def head(self, h_BxSxD: jax.Array) -> jax.Array:
        """Float32 logits [B, S, V] whatever the compute dtype (the loss never sees bf16);
        under manual tp, this device's slice of the vocabulary [B, S, V / tp]."""
        return layers.logits(_cast(self.final_norm.scale, self.config.dtype),
                             _cast(self.lm_head, self.config.dtype), h_BxSxD,
                             self.config.norm_eps)

    def __call__(self, tokens_BxS: jax.Array, seg_BxS: jax.Array,
                 pos_BxS: jax.Array) -> jax.Array:
        h_BxSxD = self.embed(tokens_BxS, pos_BxS)
        for block in self.blocks:
            h_BxSxD = block(h_BxSxD, seg_BxS, pos_BxS)
        return self.head(h_BxSxD)
