"""The fused kernel's blocks fit the GPU's shared memory (estimate calibrated on an H100), and a
kernel that does not compile falls back to smaller blocks, then to the block-sparse scan, with
one warning; the chosen kernel gives the reference's values and gradients."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools
import warnings
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resihp_jax.attention import check as attention_check, block_sizes as flash_fit, flash
from resihp_jax.attention.kernels import dense_attention, segment_attention
from resihp_jax.models.config import get_model_config
from resihp_jax.attention.block_sizes import FitSettings, KernelFallbackWarning

SM90 = SimpleNamespace(compute_capability="9.0", platform="gpu")  # an H100 or H200
H100_LIMIT = 232448  # "available: 232448" in the H100's compile error
F32, BF16 = 4, 2  # item sizes


def _worst(itemsize: int, head_dim: int, block: int) -> int:
    return max(flash_fit.shared_memory_bytes(itemsize, head_dim, block, block).values())


def test_estimate_reproduces_the_measured_points():
    """One H100: float32 head dim 64 at blocks 128 asked 264192 bytes and failed; float32 at
    64 and bfloat16 at 128 (head dims 64, 128) compiled and ran."""
    limit = flash_fit.device_shared_memory(SM90)
    assert limit == H100_LIMIT
    assert _worst(F32, 64, 128) == 264192  # the compile error's "requested"
    for itemsize, head_dim, block in ((F32, 64, 64), (BF16, 64, 128), (BF16, 128, 128)):
        assert _worst(itemsize, head_dim, block) <= limit, (itemsize, head_dim, block)


def test_device_limit_as_reported_else_by_compute_capability():
    reported = SimpleNamespace(shared_memory_per_block_optin=123456, compute_capability="9.0")
    assert flash_fit.device_shared_memory(reported) == 123456
    by_capability = {"9.0": 232448, "8.0": 166912, "8.6": 101376, "8.9": 101376}
    for capability, limit in by_capability.items():
        device = SimpleNamespace(compute_capability=capability)
        assert flash_fit.device_shared_memory(device) == limit
    smallest = min(by_capability.values())
    assert flash_fit.device_shared_memory(SimpleNamespace(compute_capability="12.0")) == smallest
    assert flash_fit.device_shared_memory(jax.devices()[0]) == smallest  # reports neither


def test_chooser_halves_float32_on_sm90_and_keeps_bfloat16():
    limit = flash_fit.device_shared_memory(SM90)
    assert flash_fit.fit_block(128, F32, 64, limit) == 64
    assert flash_fit.fit_block(128, BF16, 64, limit) == 128
    assert flash_fit.fit_block(128, BF16, 128, limit) == 128
    assert flash_fit.fit_block(64, F32, 64, limit) == 64  # never above the request


@pytest.mark.parametrize("limit", [H100_LIMIT, 166912, 101376, 4096])
def test_blocks_stay_between_min_block_and_the_request_and_are_the_largest_that_fit(limit):
    for itemsize in (BF16, F32):
        for head_dim in (16, 32, 64, 128, 256):
            for request in (16, 32, 64, 128, 256, 512):
                block = flash_fit.fit_block(request, itemsize, head_dim, limit)
                case = (limit, itemsize, head_dim, request, block)
                assert flash.MIN_BLOCK <= block <= request, case
                assert block & (block - 1) == 0 and request % block == 0, case
                fits = functools.partial(flash_fit.fits, itemsize, head_dim, limit=limit)
                assert block == flash.MIN_BLOCK or fits(block), case
                assert block == request or not fits(2 * block), case


def test_no_probe_where_kernels_run_interpreted():
    def never(config, block):
        raise AssertionError("compiled off a GPU")

    with flash_fit.fitting(FitSettings(compile_fn=never)):  # probes GPU platforms only
        choice = flash_fit.choose(flash_fit.config_for("cpu", jnp.float32, 64, 4, 2, 128))
    assert (choice.implementation, choice.block_q, choice.block_k) == ("pallas", 128, 128)


S, H, G = 128, 2, 1  # tokens per row, query heads, kv heads
_ERROR = ("RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested 264192, "
          "available: 232448\nsecond line of the compiler's message")


def _inputs(d: int, s: int = S, seed: int = 0):
    """Two rows: documents crossing blocks, a one-token document, padding."""
    keys = jax.random.split(jax.random.key(seed), 4)
    seg = np.zeros((2, s), np.int32)
    seg[0] = np.repeat([1, 2, 3, 4], [s // 4 + 3, s // 2, 1, s // 4 - 4])
    seg[1, :s - 9] = np.repeat([5, 6], [9, s - 18])
    return (jax.random.normal(keys[0], (2, s, H, d)), jax.random.normal(keys[1], (2, s, G, d)),
            jax.random.normal(keys[2], (2, s, G, d)), jax.random.normal(keys[3], (2, s, H, d)),
            jnp.asarray(seg))


def _value_and_grads(attn, q, k, v, w, seg):
    def loss(q, k, v):
        o = attn(q, k, v, seg)
        return jnp.sum(o * w), o
    (_, o), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    return o, grads


def _compiler(tried: list[int], largest_that_compiles: int | None, real: bool = False):
    """A compile that fails above `largest_that_compiles` (always, if None); at or below it
    the real ahead-of-time compile of the interpreted kernel runs when `real`."""
    def compile_fn(config: flash_fit.KernelConfig, block: int) -> None:
        tried.append(block)
        if largest_that_compiles is None or block > largest_that_compiles:
            raise RuntimeError(_ERROR)
        if real:
            flash_fit.compile_kernel(config, block, interpret=True)
    return compile_fn


def _fallback_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, KernelFallbackWarning)]


def test_failing_compiles_halve_then_fall_back_to_blocksparse_with_one_warning():
    tried: list[int] = []
    settings = FitSettings(compile_fn=_compiler(tried, None), platforms=("cpu",),
                           limit=H100_LIMIT)
    q, k, v, _, seg = _inputs(64)
    attend = functools.partial(segment_attention, block_size=128, implementation="pallas")
    with flash_fit.fitting(settings), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o = jax.jit(attend)(q, k, v, seg)
        o_again = jax.jit(attend)(q[:1], k[:1], v[:1], seg[:1])  # same configuration
        choice = attention_check.select_kernel(
            "pallas", platform="cpu", seq_len=S, block_size=128, head_dim=64, n_heads=H,
            n_kv_heads=G, dtype="float32")
    # The estimate starts float32 head dim 64 at 64 on an H100; each failure halves.
    assert tried == [64, 32, 16]
    assert (choice.implementation, choice.block_q) == ("blocksparse", 128)
    [message] = _fallback_warnings(caught)
    for part in ("dtype='float32'", "head_dim=64", "block=128", "platform='cpu'",
                 "RuntimeError: RESOURCE_EXHAUSTED: Shared memory size limit exceeded",
                 "running blocksparse"):
        assert part in message
    assert "second line" not in message
    want = dense_attention(q, k, v, seg)
    np.testing.assert_allclose(o, want, atol=2e-6)
    np.testing.assert_allclose(o_again, want[:1], atol=2e-6)


def test_halved_blocks_chosen_while_the_step_is_traced_match_the_requested_ones():
    """The probe compiles (really, ahead of time, the interpreted kernel on CPU) while the
    user's jitted step is being traced; blocks 32 fail, 16 run, with one warning, and give
    the values and gradients of the requested blocks and of the dense reference."""
    tried: list[int] = []
    settings = FitSettings(compile_fn=_compiler(tried, 16, real=True), platforms=("cpu",),
                           limit=H100_LIMIT)
    q, k, v, w, seg = _inputs(16, s=64)
    attend = functools.partial(segment_attention, block_size=32, implementation="pallas")
    with flash_fit.fitting(settings), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o, grads = jax.jit(functools.partial(_value_and_grads, attend))(q, k, v, w, seg)
        choice = flash_fit.choose(flash_fit.config_for("cpu", jnp.float32, 16, H, G, 32))
    assert tried == [32, 16]
    assert (choice.implementation, choice.block_q, choice.block_k) == ("pallas", 16, 16)
    [message] = _fallback_warnings(caught)
    assert "running pallas with blocks 16x16" in message
    requested = functools.partial(flash.flash_attention, block_q=32, block_k=32, interpret=True)
    o_req, grads_req = jax.jit(functools.partial(_value_and_grads, requested))(q, k, v, w, seg)
    o_ref, grads_ref = _value_and_grads(dense_attention, q, k, v, w, seg)
    np.testing.assert_allclose(o, o_req, atol=1e-6)
    np.testing.assert_allclose(o, o_ref, atol=2e-5)
    for name, got, req, ref in zip("qkv", grads, grads_req, grads_ref, strict=True):
        np.testing.assert_allclose(got, req, atol=1e-5, err_msg=f"d{name} vs blocks 32")
        np.testing.assert_allclose(got, ref, atol=2e-5, err_msg=f"d{name} vs dense")


def test_the_step_is_built_with_the_kernel_that_runs():
    """A step on a GPU whose fused kernel does not compile is built (and reported) with the
    block-sparse kernel; nothing runs on the fake device."""
    tried: list[int] = []
    gpu = SimpleNamespace(platform="gpu", compute_capability="9.0")
    model = get_model_config("tiny", attn_block=32)
    settings = FitSettings(compile_fn=_compiler(tried, None), limit=H100_LIMIT)
    with flash_fit.fitting(settings), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert attention_check.step_attention("auto", model, 128, gpu) == "blocksparse"
    assert tried == [32, 16]
    assert len(_fallback_warnings(caught)) == 1
