"""The fused Pallas kernel (interpreted on CPU) equals the dense reference; its loops grow with
sum l^2; it lowers to Triton for CUDA; kernel selection and the start-up leakage check."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import AxisType, PartitionSpec as P

from resihp_jax.errors import ConfigError
from resihp_jax.attention import check as attention_check, block_sizes as flash_fit, flash
from resihp_jax.attention.kernels import (
    computed_block_pairs,
    dense_attention,
    resolve_implementation,
    segment_attention,
)
from resihp_jax.models.config import get_model_config

S, T, H, K = 64, 16, 4, 16  # tokens per row, block size, query heads, head dim


def _packings_BxS() -> np.ndarray:
    """One doc, docs crossing blocks, padded end, all padding, one-token docs, ids unordered."""
    rows = np.zeros((5, S), np.int32)
    rows[0] = 1
    rows[1] = np.repeat([1, 2, 3, 4, 5, 6, 7], [5, 20, 3, 9, 17, 1, 9])
    rows[2, :41] = np.repeat([1, 2], [23, 18])
    rows[4] = np.repeat([3, 9, 4, 1, 6, 5], [1, 1, 30, 1, 15, 16])
    return rows


def _qkv(b: int, g: int, d: int = K, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(keys[0], (b, S, H, d)), jax.random.normal(keys[1], (b, S, g, d)),
            jax.random.normal(keys[2], (b, S, g, d)), jax.random.normal(keys[3], (b, S, H, d)))


def _value_and_grads(attn, q, k, v, w, seg):
    def loss(q, k, v):
        o = attn(q, k, v, seg)
        return jnp.sum(o * w), o
    (_, o), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    return o, grads


def _assert_matches_dense(attn, q, k, v, w, seg, atol=2e-5):
    got_o, got = jax.jit(functools.partial(_value_and_grads, attn))(q, k, v, w, seg)
    want_o, want = _value_and_grads(dense_attention, q, k, v, w, seg)
    np.testing.assert_allclose(got_o, want_o, atol=atol, err_msg="output")
    for name, a, b in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=atol, err_msg=f"d{name}")
    return np.asarray(got_o)


def _pallas(block_q: int = T, block_k: int = T):
    return functools.partial(flash.flash_attention, block_q=block_q, block_k=block_k,
                             interpret=True)


@pytest.mark.parametrize("g", [4, 1], ids=["mha", "gqa_4_per_kv_head"])
def test_values_and_grads_match_dense(g):
    seg = jnp.asarray(_packings_BxS())
    q, k, v, w = _qkv(seg.shape[0], g)
    o = _assert_matches_dense(_pallas(), q, k, v, w, seg)
    assert np.all(o[np.asarray(seg) == 0] == 0.0)  # padding outputs exactly 0


def test_unequal_blocks_padded_head_dim_and_bfloat16():
    seg = jnp.asarray(_packings_BxS()[1:3])
    q, k, v, w = _qkv(2, 2, d=8)  # head dim 8: padded to Triton's 16 inside
    _assert_matches_dense(_pallas(block_q=16, block_k=32), q, k, v, w, seg)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    ob = jax.jit(_pallas())(qb, kb, vb, seg)
    assert ob.dtype == jnp.bfloat16
    want = dense_attention(*(x.astype(jnp.float32) for x in (qb, kb, vb)), seg)
    np.testing.assert_allclose(ob.astype(jnp.float32), want, atol=3e-2)


def test_segment_attention_dispatches_every_implementation():
    seg = jnp.asarray(_packings_BxS()[:2])
    q, k, v, _ = _qkv(2, 2)
    want = dense_attention(q, k, v, seg)
    for name in ("auto", "blocksparse", "pallas", "dense"):
        got = jax.jit(functools.partial(segment_attention, block_size=T,
                                        implementation=name))(q, k, v, seg)
        np.testing.assert_allclose(got, want, atol=2e-6, err_msg=name)
    with pytest.raises(ConfigError,
                       match="'flash'.*auto, blocksparse, pallas, cudnn, tokamax, dense"):
        segment_attention(q, k, v, seg, block_size=T, implementation="flash")


def test_kernel_loops_over_the_bounds_function(monkeypatch):
    """Narrow the key loops to the diagonal block: queries whose documents start in an
    earlier block now miss keys, so the kernel's loops are the function's ranges."""
    seg = jnp.asarray(_packings_BxS()[:1])  # one document over 4 blocks
    q, k, v, _ = _qkv(1, 4)
    ranges = flash.key_block_ranges
    diagonal = lambda seg, bq, bk: (ranges(seg, bq, bk)[1],) * 2  # noqa: E731
    monkeypatch.setattr(flash, "key_block_ranges", diagonal)
    o = np.asarray(jax.jit(_pallas())(q, k, v, seg))
    want = np.asarray(dense_attention(q, k, v, seg))
    np.testing.assert_allclose(o[:, :T], want[:, :T], atol=2e-6)  # first block: all it needs
    assert np.abs(o[:, T:] - want[:, T:]).min() > 0  # later blocks lost their earlier keys


def _equal_documents(n_docs: int, seq: int) -> np.ndarray:
    return np.repeat(np.arange(1, n_docs + 1), seq // n_docs)[None]


def test_visited_blocks_grow_with_sum_of_squared_lengths():
    seq, block = 256, 16
    # k equal documents of m = 16/k blocks each: k * m(m+1)/2 pairs, the same as the scan
    for k_docs, pairs in ((1, 136), (2, 72), (4, 40), (8, 24), (16, 16)):
        seg = _equal_documents(k_docs, seq)
        assert flash.visited_blocks(seg, block, block) == {"forward": pairs, "dkv": pairs}
        assert computed_block_pairs(seg, block) == pairs
    rng = np.random.default_rng(0)
    sum_l2, visited = [], []
    for _ in range(40):
        cuts = np.sort(rng.choice(np.arange(1, seq), size=rng.integers(0, 12), replace=False))
        lengths = np.diff(np.concatenate([[0], cuts, [seq]]))
        seg = np.repeat(np.arange(1, len(lengths) + 1), lengths)[None]
        counts = flash.visited_blocks(seg, block, block)
        blocks = np.ceil(lengths / block) + 1  # a document touches at most this many blocks
        assert counts["forward"] <= np.sum(blocks * (blocks + 1) / 2)
        assert counts["dkv"] <= np.sum(blocks * (blocks + 1) / 2)
        sum_l2.append(np.sum(lengths.astype(float) ** 2))
        visited.append(counts["forward"])
    fit = np.polyfit(sum_l2, visited, 1)
    residual = np.asarray(visited) - np.polyval(fit, sum_l2)
    r2 = 1 - residual.var() / np.var(visited)
    assert r2 > 0.95 and abs(fit[0] * 2 * block * block - 1) < 0.25, (r2, fit)
    assert flash.visited_blocks(np.zeros((2, seq), np.int32), block, block)["forward"] == 0


def test_block_ranges_on_jax_and_numpy_agree():
    seg = _packings_BxS()
    for fn in (flash.key_block_ranges, flash.query_block_ranges):
        on_jax = jax.jit(functools.partial(fn, block_q=16, block_k=32))(jnp.asarray(seg))
        for a, b in zip(fn(seg, 16, 32), on_jax, strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))


# bfloat16 at blocks 64; float32 head dim 64 at the blocks fitted to an H100 for the presets'
# 128 (its own 128 asks more shared memory than the H100 has)
_H100_F32_BLOCK = flash_fit.fit_block(
    128, 4, 64, flash_fit.device_shared_memory(SimpleNamespace(compute_capability="9.0")))


@pytest.mark.parametrize("dtype,block", [(jnp.bfloat16, 64), (jnp.float32, _H100_F32_BLOCK)],
                         ids=["bfloat16", "float32_fitted"])
def test_lowers_to_triton_for_cuda_without_a_gpu(dtype, block):
    """Pallas's Triton lowering (power-of-two tiles, supported ops) runs on any host; what
    stays for a GPU is Triton's own compile."""
    q = jax.ShapeDtypeStruct((2, 256, 8, 64), dtype)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 64), dtype)
    seg = jax.ShapeDtypeStruct((2, 256), jnp.int32)
    kernel = functools.partial(flash.flash_attention, block_q=block, block_k=block,
                               interpret=False)
    grads = jax.grad(lambda q, k, v, s: kernel(q, k, v, s).astype(jnp.float32).sum(), (0, 1, 2))
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = export.export(jax.jit(grads), platforms=["cuda"],
                             disabled_checks=[triton])(q, kv, kv, seg)
    text = exported.mlir_module()
    for name in ("packed_flash_forward", "packed_flash_dq", "packed_flash_dkv"):
        assert name in text


def test_selection_per_backend_and_sizes():
    assert resolve_implementation("auto", "cpu") == "blocksparse"
    assert resolve_implementation("auto", "gpu", seq_len=256, block_size=64) == "cudnn"
    assert resolve_implementation("auto", "gpu", seq_len=96, block_size=24) == "blocksparse"
    assert resolve_implementation("auto", "gpu", seq_len=64, block_size=8) == "blocksparse"
    assert resolve_implementation("dense", "gpu") == "dense"
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:2])
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # a Triton call cannot be split
        assert resolve_implementation("auto", "gpu") == "blocksparse"
    with pytest.raises(ConfigError, match="power of 2"):
        flash.flash_attention(*_qkv(1, 4)[:3], jnp.ones((1, S), jnp.int32), block_q=24,
                              block_k=16)


def test_interpreted_kernel_inside_shard_map_is_refused_clearly():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("dp",))
    q, k, v, _ = _qkv(2, 4)
    seg = jnp.ones((2, S), jnp.int32)
    spec = P("dp")
    sharded = jax.shard_map(_pallas(), mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
    with pytest.raises(ConfigError, match="blocksparse' or 'dense"):
        jax.jit(sharded)(q, k, v, seg)


def test_leakage_check_passes_the_kernel_and_catches_a_leaky_one(monkeypatch):
    attention_check._passed.clear()
    check = functools.partial(attention_check.check_attention, block_size=16, head_dim=16,
                              n_heads=4, n_kv_heads=2)
    check("pallas")
    assert ("pallas", "cpu", 16, 16, 16, 2, "float32") in attention_check._passed
    check("blocksparse")  # covered by the test suite: nothing run, nothing recorded
    assert len(attention_check._passed) == 1

    def row0_ids_everywhere(q, k, v, seg, **_):  # a batch-indexing bug of a packed kernel
        return dense_attention(q, k, v, jnp.broadcast_to(seg[:1], seg.shape))

    attention_check._passed.clear()
    monkeypatch.setattr(attention_check, "segment_attention", row0_ids_everywhere)
    with pytest.raises(attention_check.AttentionMismatch, match="'pallas' on cpu.*leak"):
        check("pallas")
    assert not attention_check._passed


def test_step_attention_per_platform():
    tiny = get_model_config("tiny")
    cpu = jax.devices()[0]
    assert attention_check.step_attention("auto", tiny, 64, cpu) == "blocksparse"
    assert attention_check.step_attention("dense", tiny, 64, cpu) == "dense"
    with pytest.raises(ConfigError, match="'pallas' needs GPUs"):
        attention_check.step_attention("pallas", tiny, 64, cpu)


def test_a_users_model_has_its_traced_kernels_checked_before_its_first_step(monkeypatch):
    """A user's model calls segment_attention from its own blocks: the configurations its
    step traced are checked once compiled, and a leaky kernel is refused there."""
    import optax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    import resihp_jax as rh  # noqa: PLC0415
    from resihp_jax.attention import kernels  # noqa: PLC0415
    from resihp_jax.step.aot import compile_program  # noqa: PLC0415
    from resihp_jax.step.model_parts import split_model  # noqa: PLC0415
    from resihp_jax.step.builder import build_model_step  # noqa: PLC0415

    cfg = get_model_config("tiny-gqa")
    parts, shell, blocks = split_model(rh.models.Llama(cfg, rngs=nnx.Rngs(0)))
    plan = rh.Plan.uniform(1, 1, 1, n_layers=cfg.n_layers, n_microbatches=1,
                           microbatch_size=2, seq_len=64)

    def program():
        return build_model_step(parts, optax.sgd(0.1), plan, jax.devices()[:1],
                               {"shell": shell, "blocks": blocks})

    monkeypatch.setattr(kernels, "TRACED_KERNELS", set())
    monkeypatch.setattr(attention_check, "TRACED_KERNELS", kernels.TRACED_KERNELS)
    compile_program(program())
    assert ("blocksparse", cfg.attn_block, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads,
            "float32") in kernels.TRACED_KERNELS

    def row0_ids_everywhere(q, k, v, seg, **_):  # a batch-indexing bug of a packed kernel
        return dense_attention(q, k, v, jnp.broadcast_to(seg[:1], seg.shape))

    # as on a GPU, where the model's "auto" traced the fused kernel
    kernels.TRACED_KERNELS.add(("pallas", 16, 16, 4, 2, "float32"))
    attention_check._passed.clear()
    monkeypatch.setattr(attention_check, "segment_attention", row0_ids_everywhere)
    with pytest.raises(attention_check.AttentionMismatch, match="'pallas' on cpu.*leak"):
        compile_program(program())
