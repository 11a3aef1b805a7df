"""Models written the way users write them (never part of the package): GPT-2 style, with
logical axis names on their kernels, for the tests of the user-model path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

INIT = nnx.initializers.normal(0.02)


def dense(d_in: int, d_out: int, names: tuple[str, str], rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, kernel_init=nnx.with_partitioning(INIT, names), rngs=rngs)


def masked_attention(q_BxSxHxK, k_BxSxHxK, v_BxSxHxK, seg_BxS):
    """Dense causal attention that never crosses a document boundary."""
    s = q_BxSxHxK.shape[1]
    causal_SxS = jnp.tril(jnp.ones((s, s), bool))
    same_BxSxS = seg_BxS[:, :, None] == seg_BxS[:, None, :]
    mask_Bx1xSxS = (causal_SxS[None] & same_BxSxS)[:, None]
    logits = jnp.einsum("bqhk,bshk->bhqs", q_BxSxHxK, k_BxSxHxK) / jnp.sqrt(q_BxSxHxK.shape[-1])
    logits = jnp.where(mask_Bx1xSxS, logits, -1e9)
    return jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(logits, axis=-1), v_BxSxHxK)


class GPT2Block(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs) -> None:
        self.heads = heads
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = dense(d, 3 * d, ("embed", "heads"), rngs)
        self.proj = dense(d, d, ("heads", "embed"), rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = dense(d, 4 * d, ("embed", "mlp"), rngs)
        self.down = dense(4 * d, d, ("mlp", "embed"), rngs)

    def __call__(self, h_BxSxD, seg_BxS, pos_BxS):
        b, s, d = h_BxSxD.shape
        qkv = self.qkv(self.ln1(h_BxSxD)).reshape(b, s, 3, self.heads, d // self.heads)
        att = masked_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], seg_BxS)
        h_BxSxD = h_BxSxD + self.proj(att.reshape(b, s, d))
        return h_BxSxD + self.down(jax.nn.gelu(self.up(self.ln2(h_BxSxD))))


class GPT2(nnx.Module):
    def __init__(self, vocab: int = 256, d: int = 32, heads: int = 4, n_layers: int = 4,
                 max_len: int = 64, *, rngs: nnx.Rngs) -> None:
        self.wte = nnx.Embed(vocab, d, embedding_init=nnx.with_partitioning(
            INIT, ("vocab", "embed")), rngs=rngs)
        self.wpe = nnx.Embed(max_len, d, embedding_init=INIT, rngs=rngs)
        self.blocks = nnx.List([GPT2Block(d, heads, rngs) for _ in range(n_layers)])
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)
        self.lm_head = dense(d, vocab, ("embed", "vocab"), rngs)

    def embed(self, tokens_BxS, positions_BxS):
        return self.wte(tokens_BxS) + self.wpe(positions_BxS)

    def head(self, h_BxSxD):
        return self.lm_head(self.ln_f(h_BxSxD))

    def __call__(self, tokens_BxS, seg_BxS, pos_BxS):
        h = self.embed(tokens_BxS, pos_BxS)
        for block in self.blocks:
            h = block(h, seg_BxS, pos_BxS)
        return self.head(h)


def make_gpt2(seed: int = 0, **kw) -> GPT2:
    with nnx.use_eager_sharding(False):
        return GPT2(rngs=nnx.Rngs(seed), **kw)
