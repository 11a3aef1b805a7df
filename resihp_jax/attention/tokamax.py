"""tokamax's attention kernels as a candidate for packed rows (`implementation="tokamax"`):
Mosaic GPU on Hopper and later, else Triton on GPUs, else XLA's. Each token is given the start
of its own document as the first key it may see (tokamax's `Mask.k_start`) and the mask is
causal, so the Mosaic kernels skip the blocks of other documents instead of masking them.

tokamax is an optional dependency (`pip install 'resihp-jax[gpu]'`; on a host without a network
its wheels travel with the tree, on `PYTHONPATH`), and the document mask is only reachable
through its private kernel table (the public `dot_product_attention` takes a boolean mask,
which costs O(S^2)). Both are imported on use; `unavailable()` says why either is missing.
Padding (segment id 0) outputs exactly 0.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from resihp_jax.attention import flash
from resihp_jax.errors import ConfigError

# the kernels tried in turn, fastest first, where the platform has them (a kernel that
# refuses a shape raises NotImplementedError and the next one runs)
PREFERENCE = {"gpu": ("mosaic_gpu", "triton", "xla"), "cpu": ("xla",)}


def _kernels() -> tuple[Any, Any]:
    """(tokamax's kernel table, its Mask class); ImportError where tokamax is missing.

    tokamax reads absl flags, parsing `sys.argv` on first use unless they are parsed already:
    the user's own arguments (`--steps 5`) then raise UnrecognizedFlagError inside the step.
    They are marked parsed first (every tokamax setting at its default)."""
    from absl import flags  # noqa: PLC0415 - tokamax's own dependency
    from tokamax._src.ops.attention import api, base  # noqa: PLC0415 - optional, private

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return api, base


def unavailable() -> str | None:
    """Why tokamax cannot run here (None: it can)."""
    try:
        _, base = _kernels()
    except Exception as error:  # noqa: BLE001 - an import of any failure means: not here
        return (f"the tokamax package is not importable ({type(error).__name__}: "
                f"{str(error).splitlines()[0][:120] if str(error) else 'no message'}); "
                "pip install 'resihp-jax[gpu]'")
    if "k_start" not in getattr(base.Mask, "__dataclass_fields__", {}):
        return "this tokamax's Mask takes no per-token document starts (k_start)"
    return None


def require() -> None:
    """ConfigError naming why, where tokamax cannot run."""
    why = unavailable()
    if why is not None:
        raise ConfigError(f"attention implementation 'tokamax': {why}; valid without it: "
                          "auto, blocksparse, pallas, cudnn, dense")


def document_attention(q_BxSxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array,
                       segment_ids_BxS: jax.Array, platform: str | None = None) -> jax.Array:
    """Causal attention within each document by tokamax's fastest kernel for `platform`
    (default: JAX's default backend); G divides H (grouped KV heads)."""
    api, base = _kernels()
    platform = platform or jax.default_backend()
    names = [n for n in PREFERENCE.get("gpu" if platform in ("gpu", "cuda", "rocm") else "cpu",
                                       ("xla",)) if n in api.IMPLEMENTATIONS]
    seg_BxS = segment_ids_BxS.astype(jnp.int32)
    _, start_BxS, _ = flash.document_bounds(seg_BxS)  # where each token's document starts
    mask = base.Mask(k_start=start_BxS[:, None, :], is_causal=True)
    refused: list[str] = []
    for name in names:
        try:
            out_BxSxHxK = api.IMPLEMENTATIONS[name](
                q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, bias=None, mask=mask, logits_scale=base.AUTO,
                precision=None, logits_soft_cap=None, q_sharding=None)
        except NotImplementedError as error:
            refused.append(f"{name}: {str(error).splitlines()[0][:80] if str(error) else ''}")
            continue
        return jnp.where((seg_BxS > 0)[:, :, None, None], out_BxSxHxK, 0).astype(
            q_BxSxHxK.dtype)
    raise NotImplementedError(f"no tokamax kernel takes this shape ({'; '.join(refused)})")
