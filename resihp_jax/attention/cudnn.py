"""cuDNN's packed (THD) attention as a candidate for packed rows: each row's documents are
given to cuDNN as per-row offsets and lengths, so on Hopper and later it skips the work
between documents instead of masking it (a full segment mask, as `jax.nn.dot_product_attention`
takes it, costs O(S^2) whatever the documents).

JAX exposes this only in a private module (`jax._src.cudnn.fused_attention_stablehlo`), so it
is imported on use and any failure (an older JAX, no cuDNN, a dtype or head size cuDNN does
not take) reaches the caller as an exception to fall back on. Documents are contiguous runs of
one segment id; padding (id 0) outputs exactly 0. `max_documents` is static (the kernel's grid
and softmax statistics grow with it), so `document_attention` runs cuDNN's masked attention
for a batch with a row of more than MAX_DOCUMENTS documents.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

# Documents a row may hold for the packed layout; a batch with a row holding more runs the
# masked kernel. Each slot costs cuDNN grid blocks and softmax statistics of a whole row, so
# the bound is what packed pretraining rows hold (a few long documents), not the worst case.
MAX_DOCUMENTS = 16


def _first_indices(mask_BxS: jax.Array, size: int) -> jax.Array:
    """[B, size]: the positions where `mask` holds, in order, then -1."""
    return jax.vmap(lambda m: jnp.nonzero(m, size=size, fill_value=-1)[0])(mask_BxS)


def document_spans(segment_ids_BxS: jax.Array, max_documents: int
                   ) -> tuple[jax.Array, jax.Array]:
    """(offsets [B, M+1], lengths [B, M]) of each row's documents (M = max_documents), the
    unused entries -1, as cuDNN's packed layout takes them."""
    if max_documents < 1:
        raise ValueError(f"max_documents={max_documents}: must be >= 1")
    seg_BxS = segment_ids_BxS.astype(jnp.int32)
    real_BxS = seg_BxS > 0
    edge = jnp.full((seg_BxS.shape[0], 1), -1, jnp.int32)
    before_BxS = jnp.concatenate([edge, seg_BxS[:, :-1]], axis=1)
    after_BxS = jnp.concatenate([seg_BxS[:, 1:], edge], axis=1)
    first_BxM = _first_indices(real_BxS & (seg_BxS != before_BxS), max_documents)
    last_BxM = _first_indices(real_BxS & (seg_BxS != after_BxS), max_documents)
    lengths_BxM = jnp.where(first_BxM >= 0, last_BxM - first_BxM + 1, -1)
    offsets_BxM1 = jnp.concatenate([first_BxM, edge], axis=1)
    return offsets_BxM1.astype(jnp.int32), lengths_BxM.astype(jnp.int32)


def documents_per_row(segment_ids_BxS: jax.Array) -> jax.Array:
    """[B]: how many documents (contiguous runs of one nonzero id) each row holds."""
    seg_BxS = segment_ids_BxS.astype(jnp.int32)
    before_BxS = jnp.pad(seg_BxS[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    return jnp.sum((seg_BxS > 0) & (seg_BxS != before_BxS), axis=1)


def _padding_zeroed(real_BxSx1x1: jax.Array, *xs: jax.Array) -> tuple[jax.Array, ...]:
    """The inputs with padding positions selected to 0. cuDNN's backward leaves padding
    positions' gradients undefined (NaN was seen on an H200): a select there gives them a
    gradient of exactly 0 whatever cuDNN wrote."""
    return tuple(jnp.where(real_BxSx1x1, x, jnp.zeros((), x.dtype)) for x in xs)


def masked_attention(q_BxSxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array,
                     segment_ids_BxS: jax.Array, *, implementation: str | None = "cudnn"
                     ) -> jax.Array:
    """The same attention through `jax.nn.dot_product_attention` with a segment mask (O(S^2)
    work; any number of documents). Padding attends to padding, so no query row is empty
    (an empty row's NaN would reach the documents' gradients); its outputs are then 0."""
    seg_BxS = segment_ids_BxS
    real_BxSx1x1 = (seg_BxS > 0)[:, :, None, None]
    q_BxSxHxK, k_BxSxGxK, v_BxSxGxK = _padding_zeroed(real_BxSx1x1, q_BxSxHxK, k_BxSxGxK,
                                                      v_BxSxGxK)
    mask_Bx1xSxS = (seg_BxS[:, :, None] == seg_BxS[:, None, :])[:, None]
    out_BxSxHxK = jax.nn.dot_product_attention(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK,
                                               mask=mask_Bx1xSxS, is_causal=True,
                                               implementation=implementation)
    return jnp.where(real_BxSx1x1, out_BxSxHxK, jnp.zeros((), out_BxSxHxK.dtype))


Kernel = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def document_attention(q_BxSxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array,
                       segment_ids_BxS: jax.Array, *, max_documents: int = MAX_DOCUMENTS,
                       packed: Kernel | None = None, masked: Kernel | None = None
                       ) -> jax.Array:
    """The packed layout when every row holds at most `max_documents` documents, else the
    masked kernel, chosen on the device per batch (both are compiled; cuDNN calls compile in
    milliseconds). `packed`/`masked` replace the two kernels (tests)."""
    packed = packed or (lambda *a: packed_attention(*a, max_documents=max_documents))
    masked = masked or masked_attention
    fits = jnp.max(documents_per_row(segment_ids_BxS)) <= max_documents
    return jax.lax.cond(fits, packed, masked, q_BxSxHxK, k_BxSxGxK, v_BxSxGxK,
                        segment_ids_BxS)


def packed_attention(q_BxSxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array,
                     segment_ids_BxS: jax.Array, *, max_documents: int) -> jax.Array:
    """Causal attention within each document through cuDNN's packed layout (GPU only; bf16 or
    fp16; grouped KV heads allowed). Raises on a platform or JAX that lacks it."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415

    offsets_BxM1, lengths_BxM = document_spans(segment_ids_BxS, max_documents)
    real_BxSx1x1 = (segment_ids_BxS > 0)[:, :, None, None]
    q_BxSxHxK, k_BxSxGxK, v_BxSxGxK = _padding_zeroed(real_BxSx1x1, q_BxSxHxK, k_BxSxGxK,
                                                      v_BxSxGxK)
    out_BxSxHxK = cudnn.dot_product_attention(
        q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, q_seqlen=lengths_BxM, kv_seqlen=lengths_BxM,
        q_offsets=offsets_BxM1, kv_offsets=offsets_BxM1,
        scale=1.0 / math.sqrt(q_BxSxHxK.shape[-1]),
        mask_type=cudnn.MaskType.PADDING_CAUSAL, qkv_layout="BTNH")
    # cuDNN leaves positions outside every document undefined; ours are exactly 0.
    return jnp.where(real_BxSx1x1, out_BxSxHxK, jnp.zeros((), out_BxSxHxK.dtype))
