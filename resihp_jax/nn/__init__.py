"""`rh.nn`: building blocks a user may call inside their own model's blocks (never required).

`segment_attention` is our packed causal attention: documents packed in one row never see each
other (segment ids; 0 is padding), and its work grows with the sum of squared document
lengths, so the detector's cost model holds for a model that calls it (`dense_attention`, the
masked O(S^2) reference, costs per row). Shapes: q [B, S, H, K], k and v [B, S, G, K] with G
dividing H (grouped KV heads).

`tp_sum`, `vocab_embed`, `tp_size` and `tp_index` are for a model with `tensor_parallel =
"manual"` (nn/tensor_parallel.py); `rh.nn.layers` holds the pure math they and
`rh.models.Llama` share.
"""

from resihp_jax.attention.kernels import IMPLEMENTATIONS, dense_attention, segment_attention
from resihp_jax.nn import layers
from resihp_jax.nn.tensor_parallel import tp_index, tp_size, tp_sum, vocab_embed

__all__ = ["IMPLEMENTATIONS", "dense_attention", "layers", "segment_attention", "tp_index",
           "tp_size", "tp_sum", "vocab_embed"]
