"""Attention for packed rows (several documents per row, causal within each): the kernels
(`kernels`: block-sparse scan, dense reference, and the dispatcher `segment_attention`; `flash`:
the fused Pallas kernel), the fused kernel's block sizes fitted to the GPU (`block_sizes`) and the
start-up check of the chosen kernel against the reference (`check`). Below every model: it
needs only arrays and a few integers."""
