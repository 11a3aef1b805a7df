"""`rh.nn`: building blocks a user may call inside their own model's blocks (never required).

`segment_attention` is our packed causal attention: documents packed in one row never see each
other (segment ids; 0 is padding), and its work grows with the sum of squared document
lengths, not the squared row length, so the detector's cost model holds for a model that calls
it. `implementation=` picks the kernel: "auto" (default: cuDNN's packed layout on GPUs, the
block-sparse scan elsewhere), "cudnn", "pallas" (our fused Triton kernel), "blocksparse", or
"dense" (`dense_attention`, the masked O(S^2) reference with the same semantics, whose cost
grows per row).
Shapes: q [B, S, H, K], k and v [B, S, G, K] with G dividing H (grouped KV heads).

`tp_sum`, `vocab_embed`, `tp_size` and `tp_index` are for a model that writes its tensor
parallelism into its blocks (`tensor_parallel = "manual"`, as `rh.models.Llama` does: see
nn/tensor_parallel.py); outside such a step they are the plain operations. `rh.nn.layers`
holds the pure math they and `rh.models.Llama` share (RMSNorm, rotary positions, float32
logits, the token loss).
"""

from resihp_jax.attention.kernels import IMPLEMENTATIONS, dense_attention, segment_attention
from resihp_jax.nn import layers
from resihp_jax.nn.tensor_parallel import tp_index, tp_size, tp_sum, vocab_embed

__all__ = ["IMPLEMENTATIONS", "dense_attention", "layers", "segment_attention", "tp_index",
           "tp_size", "tp_sum", "vocab_embed"]
