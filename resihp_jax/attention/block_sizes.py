"""Block sizes for the fused attention kernel that fit the GPU, and a fallback that runs.

A Triton kernel whose buffers exceed the device's shared memory per block does not compile
("Shared memory size limit exceeded"), so the largest power-of-two blocks not above the model's
block size whose estimated shared memory fits are chosen (the kernels are exact for any such
block dividing the row). A configuration's first use on a GPU compiles its forward and backward
on a small input; a failure halves the blocks, and past the smallest the block-sparse scan takes
over, with one `KernelFallbackWarning`. Choices are cached per process; compiler, limit and
probed platforms are injectable (`fitting`), so CPU tests can make compiles fail.

cuDNN's packed layout (attention/cudnn.py, the GPU default for bf16 and fp16) is probed first
the same way: where it does not compile (an older JAX or cuDNN, a GPU before Hopper, a head size
it refuses) the fused kernel's choice runs, with one `KernelFallbackWarning`; float32 goes to
the fused kernel without one (cuDNN takes 16-bit inputs only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from resihp_jax.attention import cudnn, flash

# Opt-in shared memory per thread block (cudaDevAttrMaxSharedMemoryPerBlockOptin) by compute
# capability, for devices whose runtime does not report it.
SHARED_MEMORY_BY_CAPABILITY = {"9.0": 232448, "8.0": 166912, "8.6": 101376, "8.9": 101376}
# An unknown device gets the smallest: a block too small costs speed, one too big a crash.
UNKNOWN_SHARED_MEMORY = min(SHARED_MEMORY_BY_CAPABILITY.values())
_ROW_ITEM_BYTES = 4  # lse and delta rows are float32 whatever the inputs
PROBE_BLOCKS = 4  # the probe's rows hold this many blocks: every loop runs more than once


class KernelFallbackWarning(UserWarning):
    """The fused attention kernel did not compile as first chosen; smaller blocks or the
    block-sparse kernel run instead."""


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """What a kernel choice depends on; one choice per configuration and process."""
    platform: str
    dtype: str
    head_dim: int  # padded, as the fused kernels compute (cuDNN's: the model's own)
    group: int  # query heads per kv head (the dkv kernel loops over them)
    block: int  # the model's block size: the largest block the kernels may use
    cudnn_first: bool = False  # try cuDNN's packed layout before the fused kernel


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The kernel `segment_attention` runs for a configuration, and its blocks."""
    implementation: str
    block_q: int
    block_k: int
    reason: str

    def __str__(self) -> str:
        return f"{self.implementation} blocks {self.block_q}x{self.block_k} ({self.reason})"


# ----------------------------------------------------------------------------- estimate


def shared_memory_bytes(itemsize: int, head_dim: int, block_q: int, block_k: int,
                        num_stages: int = flash.NUM_STAGES) -> dict[str, int]:
    """Estimated shared memory per block of each kernel, in bytes.

    Why this shape: Triton's software pipeliner turns each load in a loop that reaches a
    `dot` into an asynchronous copy with `num_stages` shared buffers; a dot operand loaded
    before the loop is held there once; a register tile fed to a dot transposed or re-laid
    out (p, ds) passes through one shared buffer. `num_warps` does not change the bytes.
    Calibration (one H100, jax 0.11.2): float32, head dim 64, blocks 128 requested 264192
    bytes, which is dkv's term exactly: 2 stages x (q, do: 2 x 32768 + lse, delta rows:
    2 x 512) + k, v held (2 x 32768) + p/ds (65536); float32 blocks 64 and bfloat16 head dim
    64 and 128 at blocks 128 compiled, and come out under H100's 232448 here."""
    q_tile = block_q * head_dim * itemsize
    k_tile = block_k * head_dim * itemsize
    pair_tile = block_q * block_k * itemsize
    rows = 2 * block_q * _ROW_ITEM_BYTES
    return {
        # loop: k, v; held: q; p feeds p @ v
        "forward": num_stages * 2 * k_tile + q_tile + pair_tile,
        # loop: k, v; held: q, do; ds feeds ds @ k
        "dq": num_stages * 2 * k_tile + 2 * q_tile + pair_tile,
        # loop: q, do and the lse, delta rows; held: k, v; p, ds feed p^T @ do, ds^T @ q
        "dkv": num_stages * (2 * q_tile + rows) + 2 * k_tile + pair_tile,
    }


def fits(itemsize: int, head_dim: int, block: int, limit: int) -> bool:
    return max(shared_memory_bytes(itemsize, head_dim, block, block).values()) <= limit


def fit_block(block: int, itemsize: int, head_dim: int, limit: int) -> int:
    """The largest power-of-two block <= `block` whose kernels fit `limit` bytes, never below
    MIN_BLOCK (where the compile probe decides). Halving keeps a block dividing the row."""
    while block > flash.MIN_BLOCK and not fits(itemsize, head_dim, block, limit):
        block //= 2
    return block


def device_shared_memory(device: Any) -> int:
    """Opt-in shared memory per block of `device`: as its runtime reports it, else by its
    compute capability, else the smallest of the table."""
    reported = getattr(device, "shared_memory_per_block_optin", None)
    if isinstance(reported, (int, np.integer)) and reported > 0:
        return int(reported)
    capability = str(getattr(device, "compute_capability", ""))
    return SHARED_MEMORY_BY_CAPABILITY.get(capability, UNKNOWN_SHARED_MEMORY)


# ----------------------------------------------------------------------------- compile probe

CompileFn = Callable[[KernelConfig, int], None]


def _compile_probe(attend: Callable[..., jax.Array], config: KernelConfig, block: int
                   ) -> None:
    """Compile `attend(q, k, v, seg)`'s forward and backward ahead of time on a small input
    (rows of PROBE_BLOCKS blocks); raises what JAX or the compiler raises."""
    s = PROBE_BLOCKS * block
    q = jax.ShapeDtypeStruct((1, s, config.group, config.head_dim), config.dtype)
    kv = jax.ShapeDtypeStruct((1, s, 1, config.head_dim), config.dtype)
    seg = jax.ShapeDtypeStruct((1, s), jnp.int32)
    grads = jax.grad(lambda *a: attend(*a).astype(jnp.float32).sum(), (0, 1, 2))
    jax.jit(grads).lower(q, kv, kv, seg).compile()


def compile_kernel(config: KernelConfig, block: int, *, interpret: bool = False) -> None:
    """Compile the kernels' forward and backward ahead of time on a small input at `block`."""
    _compile_probe(functools.partial(flash.flash_attention, block_q=block, block_k=block,
                                     interpret=interpret), config, block)


def compile_cudnn(config: KernelConfig, block: int) -> None:
    """Compile cuDNN's packed attention's forward and backward ahead of time."""
    _compile_probe(functools.partial(cudnn.packed_attention, max_documents=cudnn.MAX_DOCUMENTS),
                   config, block)


@dataclasses.dataclass(frozen=True)
class FitSettings:
    """compile_fn: compiles a configuration at a block or raises; platforms: where kernels
    are compiled (elsewhere they run interpreted: nothing to fit); limit: shared memory bytes
    per block (None: read from this process's first device); cudnn_compile_fn: compiles
    cuDNN's packed attention for a configuration or raises."""
    compile_fn: CompileFn = compile_kernel
    platforms: tuple[str, ...] = flash.GPU_PLATFORMS
    limit: int | None = None
    cudnn_compile_fn: CompileFn = compile_cudnn


_SETTINGS = [FitSettings()]
_CHOICES: dict[KernelConfig, KernelChoice] = {}
_LOCK = threading.RLock()  # a cuDNN probe falls back to the fused choice under it


@contextlib.contextmanager
def fitting(settings: FitSettings) -> Iterator[None]:
    """Choose kernels with `settings` inside the block, from an empty cache."""
    previous = _SETTINGS[0]
    _SETTINGS[0] = settings
    _CHOICES.clear()
    try:
        yield
    finally:
        _SETTINGS[0] = previous
        _CHOICES.clear()


def _compile_error(compile_fn: CompileFn, config: KernelConfig, block: int) -> str | None:
    """The first line of the compile's error, None when it compiled. The compile runs in its
    own thread: `segment_attention` is usually called while the user's step is being traced,
    and JAX keeps the current trace (and mesh context) per thread, so a fresh thread lowers
    and compiles the probe as a top-level program."""
    def attempt() -> str | None:
        try:
            compile_fn(config, block)
        except Exception as error:  # noqa: BLE001 - any failure means: try something smaller
            lines = str(error).strip().splitlines()
            return f"{type(error).__name__}: {lines[0] if lines else ''}"
        return None

    with ThreadPoolExecutor(1, thread_name_prefix="flash-fit") as pool:
        return pool.submit(attempt).result()


def _probe(config: KernelConfig, settings: FitSettings) -> KernelChoice:
    limit = settings.limit or device_shared_memory(jax.local_devices()[0])
    itemsize = jnp.dtype(config.dtype).itemsize
    block = fit_block(config.block, itemsize, config.head_dim, limit)
    reason = (f"fits {limit} bytes of shared memory" if block == config.block else
              f"block {config.block} needs more than {limit} bytes of shared memory")
    first_error = None
    while block >= flash.MIN_BLOCK:
        error = _compile_error(settings.compile_fn, config, block)
        if error is None:
            choice = KernelChoice("pallas", block, block, reason)
            if first_error:
                _warn(config, first_error, choice)
            return choice
        first_error = first_error or error
        reason = f"larger blocks did not compile: {first_error}"
        block //= 2
    choice = KernelChoice("blocksparse", config.block, config.block,
                          f"the fused kernel did not compile: {first_error}")
    _warn(config, first_error, choice)
    return choice


CUDNN_DTYPES = ("bfloat16", "float16")


def _probe_cudnn(config: KernelConfig, settings: FitSettings) -> KernelChoice:
    """cuDNN's packed layout where it compiles for `config`, else the fused kernel's choice."""
    fused = dataclasses.replace(config, cudnn_first=False,
                                head_dim=flash.padded_head_dim(config.head_dim))
    if config.dtype not in CUDNN_DTYPES:
        return choose(fused)
    error = _compile_error(settings.cudnn_compile_fn, config, config.block)
    if error is None:
        return KernelChoice("cudnn", config.block, config.block,
                            f"cuDNN's packed layout, up to {cudnn.MAX_DOCUMENTS} documents a "
                            "row (more: its masked kernel)")
    choice = choose(fused)
    _warn(config, error, choice, kernel="cuDNN packed attention")
    return choice


def _warn(config: KernelConfig, error: str | None, choice: KernelChoice,
          kernel: str = "fused attention kernel") -> None:
    warnings.warn(
        f"{kernel} for {config} did not compile ({error}); running "
        f"{choice.implementation} with blocks {choice.block_q}x{choice.block_k} instead",
        KernelFallbackWarning, stacklevel=4)


def config_for(platform: str, dtype: Any, head_dim: int, n_heads: int, n_kv_heads: int,
               block: int, cudnn_first: bool = False) -> KernelConfig:
    # the fused kernel computes at a padded head dim; cuDNN's is probed at the model's own
    return KernelConfig(platform, jnp.dtype(dtype).name,
                        head_dim if cudnn_first else flash.padded_head_dim(head_dim),
                        n_heads // n_kv_heads, block, cudnn_first)


def choose(config: KernelConfig) -> KernelChoice:
    """The fused kernel's blocks for `config`, or the block-sparse kernel where it does not
    compile; probed once per configuration and process where kernels are compiled."""
    settings = _SETTINGS[0]
    if config.cudnn_first and config.platform not in settings.platforms:
        choice = KernelChoice("blocksparse", config.block, config.block, "cuDNN needs a GPU")
        _warn(config, f"no GPU here ({config.platform})", choice, kernel="cuDNN packed attention")
        return choice
    if not config.cudnn_first and config.platform not in settings.platforms:
        return KernelChoice("pallas", config.block, config.block, "interpreted: no limit")
    if not config.cudnn_first and not flash.supports(config.block, config.block):
        # not a compiled block size: the kernel's own check names the value and what is valid
        return KernelChoice("pallas", config.block, config.block, "not a Triton block size")
    with _LOCK:
        if config not in _CHOICES:
            _CHOICES[config] = (_probe_cudnn if config.cudnn_first else _probe)(config, settings)
        return _CHOICES[config]
