"""GPT-2 as a user writes it (examples/user_model/train_gpt2.py, `resihp demo --model gpt2`):
learned positions, a fused qkv projection, a GELU MLP, `segment_attention`, tied embeddings;
kernels carry logical axis names only. It lives in the package so that the demo can train
it; nothing in it is private to the library.
"""

from __future__ import annotations

import jax
from flax import nnx

from resihp_jax.nn import segment_attention

ATTN_BLOCK = 32  # segment_attention's block: a row's length must be a multiple of it
_P, _INIT = nnx.with_partitioning, nnx.initializers.normal(0.02)


class GPT2Block(nnx.Module):
    """One pre-norm block: causal attention within each packed document, then a GELU MLP."""

    def __init__(self, d: int, heads: int, rngs: nnx.Rngs) -> None:
        self.heads = heads
        self.ln1, self.ln2 = (nnx.LayerNorm(d, rngs=rngs) for _ in range(2))
        self.qkv = nnx.Linear(d, 3 * d, kernel_init=_P(_INIT, ("embed", "heads")), rngs=rngs)
        self.proj = nnx.Linear(d, d, kernel_init=_P(_INIT, ("heads", "embed")), rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, kernel_init=_P(_INIT, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(4 * d, d, kernel_init=_P(_INIT, ("mlp", "embed")), rngs=rngs)

    def __call__(self, h_BxSxD: jax.Array, seg_BxS: jax.Array,
                 pos_BxS: jax.Array) -> jax.Array:
        del pos_BxS  # positions enter once, through the learned position embedding
        b, s, d = h_BxSxD.shape
        qkv = self.qkv(self.ln1(h_BxSxD)).reshape(b, s, 3, self.heads, d // self.heads)
        att_BxSxHxK = segment_attention(*(qkv[:, :, i] for i in range(3)), seg_BxS,
                                        block_size=ATTN_BLOCK)
        h_BxSxD = h_BxSxD + self.proj(att_BxSxHxK.reshape(b, s, d))
        return h_BxSxD + self.down(jax.nn.gelu(self.up(self.ln2(h_BxSxD))))


class GPT2(nnx.Module):
    """GPT-2-style decoder: `vocab` tokens, width `d`, `heads` heads, `layers` blocks, rows
    of up to `max_len` tokens (a multiple of ATTN_BLOCK)."""

    def __init__(self, vocab: int = 256, d: int = 128, heads: int = 4, layers: int = 4,
                 max_len: int = 256, *, rngs: nnx.Rngs) -> None:
        self.wte = nnx.Embed(vocab, d, embedding_init=_P(_INIT, ("vocab", "embed")), rngs=rngs)
        self.wpe = nnx.Embed(max_len, d, embedding_init=_INIT, rngs=rngs)
        self.blocks = nnx.List([GPT2Block(d, heads, rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)

    def embed(self, tokens_BxS: jax.Array, positions_BxS: jax.Array) -> jax.Array:
        return self.wte(tokens_BxS) + self.wpe(positions_BxS)

    def head(self, h_BxSxD: jax.Array) -> jax.Array:
        return self.wte.attend(self.ln_f(h_BxSxD))  # tied input and output embeddings

    def __call__(self, tokens_BxS: jax.Array, seg_BxS: jax.Array,
                 pos_BxS: jax.Array) -> jax.Array:
        h_BxSxD = self.embed(tokens_BxS, pos_BxS)
        for block in self.blocks:
            h_BxSxD = block(h_BxSxD, seg_BxS, pos_BxS)
        return self.head(h_BxSxD)
