"""cuDNN's packed layout (the GPU default for 16-bit attention): the offsets and lengths it
takes describe exactly the documents the segment ids hold; the masked kernel a batch with more
documents runs is the reference's math; the choice between them, and the fallback where cuDNN
does not compile. (The kernel itself needs a GPU: the GPU suite's kernels section checks it
against the float32 reference, and every run checks it at start-up, attention/check.py.)"""

import dataclasses
import functools
import warnings

import jax
import numpy as np
import pytest

from resihp_jax.attention import check as attention_check
from resihp_jax.attention import block_sizes as flash_fit
from resihp_jax.attention import kernels
from resihp_jax.attention.cudnn import (document_attention, document_spans, documents_per_row,
                                        masked_attention, packed_attention)
from resihp_jax.attention.kernels import dense_attention, segment_attention


@pytest.fixture(autouse=True)
def own_traced_kernels(monkeypatch):
    """The cuDNN kernels these tests trace on CPU (for export, or to see the fallback) stay
    out of the process's record, which a later test's start-up check would re-check here."""
    monkeypatch.setattr(kernels, "TRACED_KERNELS", set())
    monkeypatch.setattr(attention_check, "TRACED_KERNELS", kernels.TRACED_KERNELS)


def spans_from_runs(seg_S: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of each contiguous run of one nonzero id, by a plain loop."""
    out: list[tuple[int, int]] = []
    for i, value in enumerate(seg_S):
        if value == 0:
            continue
        if i == 0 or seg_S[i - 1] != value:
            out.append((i, 1))
        else:
            out[-1] = (out[-1][0], out[-1][1] + 1)
    return out


def test_offsets_and_lengths_are_the_rows_documents_then_minus_one():
    seg = np.zeros((3, 40), np.int32)
    seg[0] = np.repeat([1, 2, 3, 4], [10, 1, 20, 9])  # a one-token document
    seg[1, :25] = np.repeat([7, 2], [5, 20])  # trailing padding, ids out of order
    seg[2] = np.repeat(np.arange(1, 9), 5)  # exactly max_documents
    offsets, lengths = map(np.asarray, document_spans(jax.numpy.asarray(seg), 8))
    assert offsets.shape == (3, 9) and lengths.shape == (3, 8)
    for row in range(3):
        want = spans_from_runs(seg[row])
        n = len(want)
        assert [tuple(x) for x in zip(offsets[row, :n], lengths[row, :n])] == want
        assert (offsets[row, n:] == -1).all() and (lengths[row, n:] == -1).all()
    assert np.asarray(documents_per_row(jax.numpy.asarray(seg))).tolist() == [4, 2, 8]


ON_GPU = jax.devices()[0].platform == "gpu"


def test_a_bad_bound_is_refused():
    with pytest.raises(ValueError, match="max_documents=0: must be >= 1"):
        document_spans(jax.numpy.ones((1, 8), np.int32), 0)


@pytest.mark.skipif(ON_GPU, reason="a GPU has cuDNN: its numbers are checked below instead")
def test_without_a_gpu_both_kernels_are_refused_as_cudnn_not_detected():
    """The refusal the fallback (attention/block_sizes.py) reads and names in its warning."""
    seg = jax.numpy.ones((1, 8), np.int32)
    q = jax.numpy.zeros((1, 8, 2, 64), jax.numpy.bfloat16)
    for kernel in (functools.partial(packed_attention, max_documents=1), masked_attention):
        with pytest.raises(RuntimeError, match=r"(?m)\AcuDNN is not detected\.$"):
            jax.jit(kernel)(q, q, q, seg)


@pytest.mark.skipif(not ON_GPU, reason="cuDNN's kernels run on a GPU only: here there is "
                    f"{jax.devices()[0].platform}")
def test_on_a_gpu_both_kernels_are_the_float32_reference_within_bf16_rounding():
    """cuDNN's packed layout and its masked kernel, forward and backward, against the
    float32 reference on the same bf16-rounded inputs: each error relative to the
    reference's largest value, within 3e-2 (bf16 keeps 8 bits: 4e-3 an element)."""
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (2, 128, 4, 64)).astype(jax.numpy.bfloat16)
    k, v = (jax.random.normal(key, (2, 128, 2, 64)).astype(jax.numpy.bfloat16)
            for key in keys[1:])
    seg = np.zeros((2, 128), np.int32)
    seg[0] = np.repeat([1, 2, 3], [40, 1, 87])  # a one-token document
    seg[1, :100] = np.repeat([4, 9], [64, 36])  # padding at the end
    seg = jax.numpy.asarray(seg)

    def reference(q_, k_, v_, seg_):
        return dense_attention(*(x.astype(np.float32) for x in (q_, k_, v_)), seg_)

    def out_and_grads(kernel):
        def loss(*qkv):
            return jax.numpy.sum(kernel(*qkv, seg).astype(np.float32) ** 2)
        out = jax.jit(kernel)(q, k, v, seg)
        grads = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
        return [np.asarray(x, np.float32) for x in (out, *grads)]

    want = out_and_grads(reference)
    assert np.all(want[0][np.asarray(seg) == 0] == 0)
    for name, kernel in (("packed", functools.partial(packed_attention, max_documents=3)),
                         ("masked", masked_attention)):
        got = out_and_grads(kernel)
        assert np.all(got[0][np.asarray(seg) == 0] == 0), name  # padding exactly 0
        for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert np.all(np.isfinite(g)), (name, what)
            error = float(np.max(np.abs(g - w)) / np.max(np.abs(w)))
            assert error <= 3e-2, f"cuDNN {name} {what}: error {error:.2e} of the largest value"


def qkv_seg(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (2, 32, 4, 16))
    k, v = (jax.random.normal(key, (2, 32, 2, 16)) for key in keys[1:])
    seg = np.zeros((2, 32), np.int32)
    seg[0] = np.repeat([1, 2, 3], [7, 1, 24])
    seg[1, :20] = np.repeat([5, 6], [12, 8])  # padding at the end
    return q, k, v, jax.numpy.asarray(seg)


def loss_and_grads(attention, q, k, v, seg):
    def loss(q_, k_, v_):
        return jax.numpy.sum(attention(q_, k_, v_, seg) ** 2)
    return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)


def test_the_masked_fallback_is_the_reference_with_padding_exactly_zero():
    """cuDNN's masked kernel runs where a row holds more documents than the packed layout's
    bound: the same math (here through XLA's implementation of the same call)."""
    q, k, v, seg = qkv_seg()
    masked = functools.partial(masked_attention, implementation="xla")
    out = masked(q, k, v, seg)
    np.testing.assert_allclose(out, dense_attention(q, k, v, seg), atol=2e-5)
    assert np.all(np.asarray(out)[np.asarray(seg) == 0] == 0)
    (l1, g1), (l2, g2) = (loss_and_grads(f, q, k, v, seg) for f in (masked, dense_attention))
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, atol=5e-5)
        assert np.all(np.isfinite(np.asarray(a)))


def test_rows_over_the_bound_take_the_masked_kernel_per_batch():
    q, k, v, seg = qkv_seg()  # rows of 3 and 2 documents
    packed = lambda *a: jax.numpy.ones_like(a[0])  # noqa: E731 - tells the branches apart
    masked = lambda *a: -jax.numpy.ones_like(a[0])  # noqa: E731
    choose = jax.jit(functools.partial(document_attention, packed=packed, masked=masked),
                     static_argnames="max_documents")
    assert float(choose(q, k, v, seg, max_documents=3)[0, 0, 0, 0]) == 1.0
    assert float(choose(q, k, v, seg, max_documents=2)[0, 0, 0, 0]) == -1.0


def fits_settings(cudnn_error: str | None) -> flash_fit.FitSettings:
    def cudnn_compile(config, block):
        if cudnn_error:
            raise RuntimeError(cudnn_error)
    return flash_fit.FitSettings(compile_fn=lambda config, block: None, platforms=("cpu",),
                                 limit=10**9, cudnn_compile_fn=cudnn_compile)


def test_cudnn_is_chosen_where_it_compiles_else_the_fused_kernel_with_one_warning():
    config = flash_fit.config_for("cpu", "bfloat16", 64, 8, 2, 64, cudnn_first=True)
    with flash_fit.fitting(fits_settings(None)):
        assert flash_fit.choose(config).implementation == "cudnn"
    with flash_fit.fitting(fits_settings("cuDNN is not detected.")):
        with pytest.warns(flash_fit.KernelFallbackWarning, match="cuDNN is not detected"):
            choice = flash_fit.choose(config)
        assert (choice.implementation, choice.block_q) == ("pallas", 64)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert flash_fit.choose(config).implementation == "pallas"  # cached: one warning
    f32 = dataclasses.replace(config, dtype="float32")
    with flash_fit.fitting(fits_settings(None)), warnings.catch_warnings():
        warnings.simplefilter("error")  # float32 is the fused kernel's, no warning
        assert flash_fit.choose(f32).implementation == "pallas"


def test_asking_cudnn_without_a_gpu_runs_the_block_sparse_scan_with_a_warning():
    config = flash_fit.config_for("cpu", "bfloat16", 64, 8, 2, 64, cudnn_first=True)
    with pytest.warns(flash_fit.KernelFallbackWarning, match="no GPU here"):
        assert flash_fit.choose(config).implementation == "blocksparse"
    q, k, v, seg = qkv_seg()
    with pytest.warns(flash_fit.KernelFallbackWarning):
        out = segment_attention(q, k, v, seg, block_size=8, implementation="cudnn")
    np.testing.assert_allclose(out, dense_attention(q, k, v, seg), atol=2e-5)


def test_the_start_up_check_runs_both_of_cudnns_kernels_and_catches_a_leak(monkeypatch):
    """On a GPU the check runs cuDNN's packed layout and its masked kernel (rows beyond the
    bound) against the reference; here both stand in on CPU: the reference's math (it
    passes, both kernels ran) and a kernel that ignores documents (AttentionMismatch)."""
    from resihp_jax.attention import check as attention_check, cudnn

    ran: list[str] = []
    real_masked = cudnn.masked_attention

    def honest(q, k, v, seg, max_documents):
        ran.append("packed")
        return dense_attention(q, k, v, seg)

    def masked(q, k, v, seg):
        ran.append("masked")
        return real_masked(q, k, v, seg, implementation="xla")

    monkeypatch.setattr(cudnn, "packed_attention", honest)
    monkeypatch.setattr(cudnn, "masked_attention", masked)
    shape = dict(block_size=16, head_dim=16, n_heads=4, n_kv_heads=2, dtype="bfloat16")
    with flash_fit.fitting(fits_settings(None)):
        attention_check.check_attention("cudnn", **shape)
        assert sorted(set(ran)) == ["masked", "packed"]
        attention_check._passed.clear()
        leaky = lambda q, k, v, seg, max_documents: dense_attention(  # noqa: E731
            q, k, v, jax.numpy.where(seg > 0, 1, 0))
        monkeypatch.setattr(cudnn, "packed_attention", leaky)
        with pytest.raises(attention_check.AttentionMismatch, match="'cudnn'"):
            attention_check.check_attention("cudnn", **shape)
    attention_check._passed.clear()


CUDNN_TARGETS = [f"__cudnn$fmha{kind}{backward}" for kind in ("Softmax", "ScaleBiasSoftmax")
                 for backward in ("", "Backward")]


def test_inside_a_shard_map_step_both_kernels_lower_for_cuda(monkeypatch):
    """The step runs attention inside shard_map (manual dp and tp axes): cuDNN's calls and
    their gradients must trace with the varying axes and lower for CUDA. JAX asks the
    installed cuDNN for its version first: here there is none, so a version is given."""
    from jax import export
    from jax._src.cudnn import fused_attention_stablehlo as fa
    from jax.sharding import PartitionSpec as P

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fa, "check_compute_capability", lambda capability: True)
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def grads(q, k, v, seg):
        loss = lambda *a: jax.numpy.sum(document_attention(*a, seg).astype(np.float32))  # noqa: E731,E501
        return jax.grad(loss, (0, 1, 2))(q, k, v)

    heads = P("dp", None, "tp")
    step = jax.shard_map(grads, mesh=mesh, in_specs=(heads, heads, heads, P("dp")),
                         out_specs=(heads,) * 3)
    q = jax.ShapeDtypeStruct((4, 256, 8, 64), jax.numpy.bfloat16)
    kv = jax.ShapeDtypeStruct((4, 256, 2, 64), jax.numpy.bfloat16)
    seg = jax.ShapeDtypeStruct((4, 256), np.int32)
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in CUDNN_TARGETS]
    with jax.set_mesh(mesh):
        text = export.export(jax.jit(step), platforms=["cuda"],
                             disabled_checks=checks)(q, kv, kv, seg).mlir_module()
    # the packed layout and the masked kernel, each forward and backward
    assert text.count("__cudnn$fmha") >= 4
    assert "Backward" in text


def test_cudnn_is_probed_at_the_models_head_dim_and_the_fused_kernel_at_its_padded_one():
    probed: list[tuple[str, int]] = []
    settings = flash_fit.FitSettings(
        compile_fn=lambda config, block: probed.append(("fused", config.head_dim)),
        platforms=("cpu",), limit=10**9,
        cudnn_compile_fn=lambda config, block: probed.append(("cudnn", config.head_dim)) or
        (_ for _ in ()).throw(RuntimeError("head dim refused")))
    config = flash_fit.config_for("cpu", "bfloat16", 80, 8, 2, 64, cudnn_first=True)
    with flash_fit.fitting(settings), pytest.warns(flash_fit.KernelFallbackWarning):
        assert flash_fit.choose(config).implementation == "pallas"
    assert probed == [("cudnn", 80), ("fused", 128)]
