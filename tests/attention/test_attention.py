"""Block-sparse segment attention equals the dense reference: values, gradients, shard_map."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from resihp_jax.attention.kernels import (
    computed_block_pairs,
    dense_attention,
    segment_attention,
)

S, T, H, K = 64, 16, 4, 8  # tokens per row, block size, query heads, head dim


def _packings_BxS() -> np.ndarray:
    """One row per case: one doc, many short, docs crossing blocks, padded end, all padding."""
    rows = np.zeros((6, S), np.int32)
    rows[0] = 1
    rows[1] = np.repeat(np.arange(1, 17), 4)
    rows[2] = np.repeat([1, 2, 3, 4, 5, 6, 7], [5, 20, 3, 9, 17, 1, 9])
    rows[3, :41] = np.repeat([1, 2], [23, 18])
    rows[5] = np.repeat([3, 9, 4, 1], 16)  # ids not increasing: skip rule must stay exact
    return rows


def _qkv(b: int, g: int, seed: int = 0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, S, H, K), dtype)
    k = jax.random.normal(keys[1], (b, S, g, K), dtype)
    v = jax.random.normal(keys[2], (b, S, g, K), dtype)
    w = jax.random.normal(keys[3], (b, S, H, K), dtype)  # cotangent weights for the loss
    return q, k, v, w


def _loss_grads(attn, q, k, v, w, seg):
    return jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v, seg) * w), (0, 1, 2))(q, k, v)


sparse = jax.jit(functools.partial(segment_attention, block_size=T))


@pytest.mark.parametrize("g", [4, 2, 1])
def test_sparse_matches_dense_values_and_grads(g):
    seg = jnp.asarray(_packings_BxS())
    q, k, v, w = _qkv(seg.shape[0], g)
    np.testing.assert_allclose(sparse(q, k, v, seg), dense_attention(q, k, v, seg), atol=2e-6)
    got = jax.jit(functools.partial(_loss_grads, sparse))(q, k, v, w, seg)
    want = _loss_grads(dense_attention, q, k, v, w, seg)
    for name, a, b in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"d{name}")


def test_padding_outputs_zero_with_finite_grads():
    seg = jnp.asarray(_packings_BxS())
    q, k, v, w = _qkv(seg.shape[0], 2)
    o = sparse(q, k, v, seg)
    pad = np.asarray(seg) == 0
    assert np.all(np.asarray(o)[pad] == 0.0)
    grads = jax.jit(functools.partial(_loss_grads, sparse))(q, k, v, w, seg)
    for grad in grads:
        assert np.all(np.isfinite(grad))
    dq = np.asarray(grads[0])
    assert np.all(dq[pad] == 0.0)
    assert np.all(np.asarray(grads[1])[4] == 0.0)  # an all-padding row feeds nothing


def test_random_packings_match_dense():
    rng = np.random.default_rng(7)
    seg_BxS = np.zeros((4, S), np.int32)
    for row in seg_BxS:
        cuts = np.sort(rng.choice(np.arange(1, S), size=rng.integers(1, 9), replace=False))
        row[:] = np.searchsorted(cuts, np.arange(S), side="right") + 1
        row[rng.integers(S // 2, S + 1):] = 0
    seg = jnp.asarray(seg_BxS)
    q, k, v, w = _qkv(4, 2, seed=3)
    np.testing.assert_allclose(sparse(q, k, v, seg), dense_attention(q, k, v, seg), atol=2e-6)
    got = jax.jit(functools.partial(_loss_grads, sparse))(q, k, v, w, seg)
    for a, b in zip(got, _loss_grads(dense_attention, q, k, v, w, seg), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_checkpoint_and_bfloat16():
    seg = jnp.asarray(_packings_BxS())
    q, k, v, w = _qkv(seg.shape[0], 2)
    remat = jax.checkpoint(functools.partial(segment_attention, block_size=T))
    got = jax.jit(functools.partial(_loss_grads, remat))(q, k, v, w, seg)
    for a, b in zip(got, _loss_grads(dense_attention, q, k, v, w, seg), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    ob = sparse(qb, kb, vb, seg)
    assert ob.dtype == jnp.bfloat16
    np.testing.assert_allclose(ob.astype(jnp.float32), dense_attention(q, k, v, seg), atol=5e-2)


@pytest.mark.parametrize("kv_spec", [P("dp", None, "tp", None), P("dp", None, None, None)],
                         ids=["kv_heads_on_tp", "kv_replicated_on_tp"])
def test_inside_shard_map_matches_unsharded(kv_spec):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
    seg = jnp.asarray(_packings_BxS()[:4])
    g = 2 if kv_spec[2] == "tp" else 1
    q, k, v, w = _qkv(4, g, seed=1)
    qo_spec = P("dp", None, "tp", None)
    sharded = jax.shard_map(functools.partial(segment_attention, block_size=T), mesh=mesh,
                            in_specs=(qo_spec, kv_spec, kv_spec, P("dp", None)),
                            out_specs=qo_spec, check_vma=True)
    np.testing.assert_allclose(jax.jit(sharded)(q, k, v, seg), sparse(q, k, v, seg), atol=1e-6)
    got = jax.jit(functools.partial(_loss_grads, sharded))(q, k, v, w, seg)
    want = jax.jit(functools.partial(_loss_grads, sparse))(q, k, v, w, seg)
    for name, a, b in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"d{name}")


def test_bad_shapes_raise_value_error_naming_the_value():
    q, k, v, _ = _qkv(2, 2)
    seg = jnp.ones((2, S), jnp.int32)
    with pytest.raises(ValueError, match=r"S=64.*block_size=24"):
        segment_attention(q, k, v, seg, block_size=24)
    with pytest.raises(ValueError, match="block_size=0"):
        segment_attention(q, k, v, seg, block_size=0)
    with pytest.raises(ValueError, match=r"H=4.*G=3"):
        segment_attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), seg,
                          block_size=T)
    with pytest.raises(ValueError, match=r"segment_ids shape \(2, 32\)"):
        segment_attention(q, k, v, seg[:, :32], block_size=T)
    with pytest.raises(ValueError, match="k shape"):
        dense_attention(q, k, v[:, :, :1], seg)
    with pytest.raises(ValueError, match="float32"):
        dense_attention(q, k, v, seg.astype(jnp.float32))


def test_computed_block_pairs_counts_diagonal_blocks_per_document():
    four_docs = np.repeat(np.arange(1, 5), T)[None].repeat(3, 0)
    assert computed_block_pairs(four_docs, T) == 4 * 3
    assert computed_block_pairs(np.ones((1, 4 * T), np.int32), T) == 10
    two_docs = np.repeat([1, 2], [2 * T, 2 * T])[None]
    assert computed_block_pairs(two_docs, T) == 3 + 3
    padding = np.zeros((1, 4 * T), np.int32)
    assert computed_block_pairs(padding, T) == 0
    with pytest.raises(ValueError, match="block_size=5"):
        computed_block_pairs(four_docs, 5)
