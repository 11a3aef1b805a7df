"""A zoo of user models, each written in an idiom NNX users write and our own models do not
(never part of the package): the constructs the pipeline, the tensor parallelism and the
resumes must survive. Every one keeps the embed/blocks/head contract and names its kernels'
logical axes with `nnx.with_partitioning`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

INIT = nnx.initializers.normal(0.02)
VOCAB, D, HEADS, LAYERS, MAX_LEN = 256, 32, 4, 4, 64


def dense(d_in: int, d_out: int, names: tuple[str, str], rngs: nnx.Rngs, *,
          bias: bool = True, dtype=jnp.float32) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=bias, param_dtype=dtype, dtype=dtype,
                      kernel_init=nnx.with_partitioning(INIT, names), rngs=rngs)


def attention(q_BxSxHxK, k_BxSxHxK, v_BxSxHxK, seg_BxS):
    """Causal attention within each document, by `jax.nn.dot_product_attention`'s mask."""
    s = q_BxSxHxK.shape[1]
    causal_SxS = jnp.tril(jnp.ones((s, s), bool))
    same_BxSxS = seg_BxS[:, :, None] == seg_BxS[:, None, :]
    mask_Bx1xSxS = (causal_SxS[None] & same_BxSxS)[:, None]
    return jax.nn.dot_product_attention(q_BxSxHxK, k_BxSxHxK, v_BxSxHxK, mask=mask_Bx1xSxS)


def rotate_halves(x_BxSxHxK, pos_BxS):
    """Rotary positions, GPT-NeoX style: the head's two halves rotated against each other."""
    half = x_BxSxHxK.shape[-1] // 2
    freq_K = 1.0 / (10000.0 ** (jnp.arange(half) / half))
    angle_BxSxK = pos_BxS[..., None].astype(jnp.float32) * freq_K
    cos, sin = (f(angle_BxSxK)[:, :, None, :].astype(x_BxSxHxK.dtype) for f in (jnp.cos, jnp.sin))
    x1, x2 = jnp.split(x_BxSxHxK, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Decoder(nnx.Module):
    """Token and position tables, a stack of blocks, a final norm and an untied head."""

    def __init__(self, block: Callable[[nnx.Rngs], nnx.Module], *, rngs: nnx.Rngs,
                 positions: bool = True, dtype=jnp.float32) -> None:
        self.wte = nnx.Embed(VOCAB, D, param_dtype=dtype, dtype=dtype, rngs=rngs,
                             embedding_init=nnx.with_partitioning(INIT, ("vocab", "embed")))
        self.wpe = (nnx.Embed(MAX_LEN, D, param_dtype=dtype, dtype=dtype, rngs=rngs,
                              embedding_init=INIT) if positions else None)
        self.blocks = nnx.List([block(rngs) for _ in range(LAYERS)])
        self.ln_f = nnx.LayerNorm(D, param_dtype=dtype, dtype=dtype, rngs=rngs)
        self.lm_head = dense(D, VOCAB, ("embed", "vocab"), rngs, bias=False, dtype=dtype)

    def embed(self, tokens_BxS, positions_BxS):
        h = self.wte(tokens_BxS)
        return h if self.wpe is None else h + self.wpe(positions_BxS)

    def head(self, h_BxSxD):
        return self.lm_head(self.ln_f(h_BxSxD))

    def __call__(self, tokens_BxS, seg_BxS, pos_BxS):
        h = self.embed(tokens_BxS, pos_BxS)
        for block in self.blocks:
            h = block(h, seg_BxS, pos_BxS)
        return self.head(h)


class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dtype=jnp.float32) -> None:
        self.up = dense(D, 4 * D, ("embed", "mlp"), rngs, dtype=dtype)
        self.down = dense(4 * D, D, ("mlp", "embed"), rngs, dtype=dtype)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


class FusedHeadsBlock(nnx.Module):
    """A fused qkv projection cut per head (the layout that lines up with tp shards)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
        self.qkv = dense(D, 3 * D, ("embed", "heads"), rngs)
        self.proj = dense(D, D, ("heads", "embed"), rngs)
        self.mlp = Mlp(rngs)

    def __call__(self, h, seg, pos):
        b, s, _ = h.shape
        q, k, v = jnp.split(self.qkv(self.ln1(h)).reshape(b, s, HEADS, -1), 3, axis=-1)
        h = h + self.proj(attention(q, k, v, seg).reshape(b, s, D))
        return h + self.mlp(self.ln2(h))


# ---- 1. a fused qkv projection cut with jnp.split --------------------------------------------
class FusedSplitBlock(FusedHeadsBlock):
    """The same projection cut into q, k and v first: `3 * heads` rows whose thirds do not line
    up with the tp shards of the kernel's output dimension."""

    def __call__(self, h, seg, pos):
        b, s, _ = h.shape
        q, k, v = jnp.split(self.qkv(self.ln1(h)).reshape(b, s, 3 * HEADS, -1), 3, axis=2)
        h = h + self.proj(attention(q, k, v, seg).reshape(b, s, D))
        return h + self.mlp(self.ln2(h))


# ---- 2. grouped-query attention by jnp.repeat, 3. rotary positions by split halves --------
class GroupedQueryBlock(nnx.Module):
    KV_HEADS = 2

    def __init__(self, rngs: nnx.Rngs, rotary: bool = False) -> None:
        hd = D // HEADS
        self.rotary = rotary
        self.norm1, self.norm2 = nnx.RMSNorm(D, rngs=rngs), nnx.RMSNorm(D, rngs=rngs)
        self.q = dense(D, HEADS * hd, ("embed", "heads"), rngs, bias=False)
        self.k = dense(D, self.KV_HEADS * hd, ("embed", "kv"), rngs, bias=False)
        self.v = dense(D, self.KV_HEADS * hd, ("embed", "kv"), rngs, bias=False)
        self.o = dense(HEADS * hd, D, ("heads", "embed"), rngs, bias=False)
        self.mlp = Mlp(rngs)

    def __call__(self, h, seg, pos):
        b, s, _ = h.shape
        x = self.norm1(h)
        q = self.q(x).reshape(b, s, HEADS, -1)
        k = self.k(x).reshape(b, s, self.KV_HEADS, -1)
        v = self.v(x).reshape(b, s, self.KV_HEADS, -1)
        if self.rotary:
            q, k = rotate_halves(q, pos), rotate_halves(k, pos)
        k, v = (jnp.repeat(a, HEADS // self.KV_HEADS, axis=2) for a in (k, v))
        h = h + self.o(attention(q, k, v, seg).reshape(b, s, -1))
        return h + self.mlp(self.norm2(h))


class RotaryBlock(GroupedQueryBlock):
    KV_HEADS = HEADS

    def __init__(self, rngs: nnx.Rngs) -> None:
        super().__init__(rngs, rotary=True)


# ---- 4. tied input and output embeddings (GPT-2's head calls Embed.attend) ---------------
class TiedDecoder(Decoder):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        super().__init__(FusedHeadsBlock, rngs=rngs)
        del self.lm_head

    def head(self, h_BxSxD):
        return self.wte.attend(self.ln_f(h_BxSxD))


# ---- 5. LayerNorm with bias and a parallel residual (GPT-J, NeoX) ------------------------
class ParallelBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.ln = nnx.LayerNorm(D, use_bias=True, rngs=rngs)
        self.q = dense(D, D, ("embed", "heads"), rngs)
        self.k = dense(D, D, ("embed", "heads"), rngs)
        self.v = dense(D, D, ("embed", "heads"), rngs)
        self.o = dense(D, D, ("heads", "embed"), rngs)
        self.mlp = Mlp(rngs)

    def __call__(self, h, seg, pos):
        b, s, _ = h.shape
        x = self.ln(h)
        q, k, v = (f(x).reshape(b, s, HEADS, -1) for f in (self.q, self.k, self.v))
        return h + self.o(attention(q, k, v, seg).reshape(b, s, D)) + self.mlp(x)


# ---- 6. SwiGLU ---------------------------------------------------------------------------
class SwiGLUBlock(FusedHeadsBlock):
    def __init__(self, rngs: nnx.Rngs) -> None:
        super().__init__(rngs)
        self.mlp = SwiGLU(rngs)


class SwiGLU(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.gate = dense(D, 2 * D, ("embed", "mlp"), rngs, bias=False)
        self.up = dense(D, 2 * D, ("embed", "mlp"), rngs, bias=False)
        self.down = dense(2 * D, D, ("mlp", "embed"), rngs, bias=False)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


# ---- 7. nnx.Dropout with an rngs stream --------------------------------------------------
class DropoutBlock(FusedHeadsBlock):
    def __init__(self, rngs: nnx.Rngs) -> None:
        super().__init__(rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, h, seg, pos):
        return super().__call__(self.drop(h), seg, pos)


# ---- 8. parameters kept in bfloat16 ------------------------------------------------------
class Bf16Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        bf16 = jnp.bfloat16
        self.ln1 = nnx.LayerNorm(D, param_dtype=bf16, dtype=bf16, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, param_dtype=bf16, dtype=bf16, rngs=rngs)
        self.qkv = dense(D, 3 * D, ("embed", "heads"), rngs, dtype=bf16)
        self.proj = dense(D, D, ("heads", "embed"), rngs, dtype=bf16)
        self.mlp = Mlp(rngs, dtype=bf16)

    def __call__(self, h, seg, pos):
        return FusedHeadsBlock.__call__(self, h, seg, pos)


# ---- 9. flax's own MultiHeadAttention under nnx.remat, an nnx.Sequential MLP ---------------
class LibraryBlock(nnx.Module):
    """What NNX hands a user ready-made: `nnx.MultiHeadAttention` (a mask of causal pairs
    within each document, no logical names: replicated), an `nnx.Sequential` holding a plain
    function, and the call under `nnx.remat`."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False,
                                           kernel_init=INIT, rngs=rngs)
        self.mlp = nnx.Sequential(dense(D, 2 * D, ("embed", "mlp"), rngs), jax.nn.relu,
                                  dense(2 * D, D, ("mlp", "embed"), rngs))

    @nnx.remat
    def __call__(self, h, seg, pos):
        s = h.shape[1]
        mask = (jnp.tril(jnp.ones((s, s), bool))[None]
                & (seg[:, :, None] == seg[:, None, :]))[:, None]
        h = h + self.attn(self.ln1(h), mask=mask, deterministic=True)
        return h + self.mlp(self.ln2(h))


ZOO: dict[str, Callable[[nnx.Rngs], nnx.Module]] = {
    "fused qkv jnp.split": lambda rngs: Decoder(FusedSplitBlock, rngs=rngs),
    "grouped-query jnp.repeat": lambda rngs: Decoder(GroupedQueryBlock, rngs=rngs),
    "rotary split halves": lambda rngs: Decoder(RotaryBlock, rngs=rngs, positions=False),
    "tied embeddings": lambda rngs: TiedDecoder(rngs=rngs),
    "layernorm bias, parallel residual": lambda rngs: Decoder(ParallelBlock, rngs=rngs),
    "swiglu": lambda rngs: Decoder(SwiGLUBlock, rngs=rngs),
    "dropout": lambda rngs: Decoder(DropoutBlock, rngs=rngs),
    "bfloat16 parameters": lambda rngs: Decoder(Bf16Block, rngs=rngs, dtype=jnp.bfloat16),
    "flax MultiHeadAttention, remat, Sequential": lambda rngs: Decoder(LibraryBlock, rngs=rngs),
}


def make(name: str, seed: int = 0) -> nnx.Module:
    """The zoo's model `name`, built on the host as a user's script builds it."""
    with nnx.use_eager_sharding(False):
        return ZOO[name](nnx.Rngs(seed))
