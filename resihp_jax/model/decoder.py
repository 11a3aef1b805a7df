"""Flax NNX decoder-only transformer (Llama style) whose parameters carry logical axis names.

The layers are stored stacked, `[n_layers, ...]` (the canonical layout checkpoints hold), so
the train step can split them into pipeline stages without touching the model code. The
math lives in `layers.py` as pure functions shared with the sharded train step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from resihp_jax.model import layers
from resihp_jax.model.config import ModelConfig

# Logical axis names of every parameter; meshes/rules.py maps them onto mesh axes.
LOGICAL_AXES: dict[str, dict[str, tuple[str, ...]]] = {
    "embed": {"table": ("vocab", "embed")},
    "layers": {
        "attn_norm": ("layers", "embed"),
        "wq": ("layers", "embed", "heads", "head_dim"),
        "wk": ("layers", "embed", "kv_heads", "head_dim"),
        "wv": ("layers", "embed", "kv_heads", "head_dim"),
        "wo": ("layers", "heads", "head_dim", "embed"),
        "mlp_norm": ("layers", "embed"),
        "w_gate": ("layers", "embed", "mlp"),
        "w_up": ("layers", "embed", "mlp"),
        "w_down": ("layers", "mlp", "embed"),
    },
    "head": {"norm": ("embed",), "w": ("embed", "vocab")},
}


def _param(value: jax.Array, names: tuple[str, ...]) -> nnx.Param:
    # Sharding is applied by the train step from these names, never eagerly at creation.
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> jax.Array:
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


class Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.table = _param(_normal(rngs, (cfg.vocab_size, cfg.d_model), 1.0),
                            LOGICAL_AXES["embed"]["table"])


class DecoderLayers(nnx.Module):
    """All decoder layers, each weight stacked on a leading `layers` axis."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        n, d, h, g, k, f = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads,
                            cfg.head_dim, cfg.d_ff)
        std = d ** -0.5
        out_std = std / (2 * n) ** 0.5  # keeps the residual stream's scale flat with depth
        names = LOGICAL_AXES["layers"]
        self.attn_norm = _param(jnp.ones((n, d)), names["attn_norm"])
        self.wq = _param(_normal(rngs, (n, d, h, k), std), names["wq"])
        self.wk = _param(_normal(rngs, (n, d, g, k), std), names["wk"])
        self.wv = _param(_normal(rngs, (n, d, g, k), std), names["wv"])
        self.wo = _param(_normal(rngs, (n, h, k, d), out_std), names["wo"])
        self.mlp_norm = _param(jnp.ones((n, d)), names["mlp_norm"])
        self.w_gate = _param(_normal(rngs, (n, d, f), std), names["w_gate"])
        self.w_up = _param(_normal(rngs, (n, d, f), std), names["w_up"])
        self.w_down = _param(_normal(rngs, (n, f, d), f ** -0.5 / (2 * n) ** 0.5),
                             names["w_down"])


class Head(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.norm = _param(jnp.ones((cfg.d_model,)), LOGICAL_AXES["head"]["norm"])
        self.w = _param(_normal(rngs, (cfg.d_model, cfg.vocab_size), cfg.d_model ** -0.5),
                        LOGICAL_AXES["head"]["w"])


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg, rngs)
        self.layers = DecoderLayers(cfg, rngs)
        self.head = Head(cfg, rngs)

    def __call__(self, tokens_BxS: jax.Array, seg_BxS: jax.Array,
                 pos_BxS: jax.Array) -> jax.Array:
        """Full-vocabulary logits [B, S, V] on whole (unsharded) weights."""
        return forward_logits(canonical_params(self), tokens_BxS, seg_BxS, pos_BxS, self.cfg)


def canonical_params(model: Decoder) -> dict[str, Any]:
    """The model's parameters as a plain nested dict of arrays (layers stacked)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def init_params(cfg: ModelConfig, seed: int) -> dict[str, Any]:
    """Canonical parameters for `seed`; call under jit with out_shardings to init sharded."""
    return canonical_params(Decoder(cfg, nnx.Rngs(params=seed)))


def forward_logits(params: dict[str, Any], tokens_BxS: jax.Array, seg_BxS: jax.Array,
                   pos_BxS: jax.Array, cfg: ModelConfig, attention: str = "auto") -> jax.Array:
    # Layers and head compute in cfg.dtype from a copy of the float32 masters; autodiff
    # through the cast hands the gradients back in float32. The embedding gathers float32
    # rows and casts only those.
    x_BxSxD = layers.embed(params["embed"]["table"], tokens_BxS, dtype=cfg.dtype)
    layer_weights = layers.compute_weights(params["layers"], cfg.dtype)
    head = layers.compute_weights(params["head"], cfg.dtype)

    def one_layer(x: jax.Array, p_layer: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        return layers.block(p_layer, x, seg_BxS, pos_BxS, cfg, attention=attention), None

    x_BxSxD, _ = jax.lax.scan(one_layer, x_BxSxD, layer_weights)
    return layers.logits(head["norm"], head["w"], x_BxSxD, cfg)


def loss_sum_and_count(params: dict[str, Any], tokens_BxS: jax.Array, seg_BxS: jax.Array,
                       pos_BxS: jax.Array, cfg: ModelConfig,
                       attention: str = "auto") -> tuple[jax.Array, jax.Array]:
    """(sum of next-token cross-entropy, number of trained tokens) for one micro-batch."""
    logits_BxSxV = forward_logits(params, tokens_BxS, seg_BxS, pos_BxS, cfg, attention)
    targets_BxS, weights_BxS = layers.next_token_targets(tokens_BxS, seg_BxS)
    return layers.token_loss_sum(logits_BxSxV, targets_BxS, weights_BxS), jnp.sum(weights_BxS)
