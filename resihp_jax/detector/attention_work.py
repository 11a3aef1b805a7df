"""The attention feature the runtime hands the detector: what the kernel really computes.

The block-sparse attention skips (query block, key block) pairs that share no segment, so its
cost is proportional to the number of computed block pairs, not to sum l_i^2 (a document that
straddles a block boundary costs whole blocks; short documents cost at least a block each).
`mb_block_pair_l2` expresses that count in sum-l^2 units (pairs x block^2) so it can be fed
wherever the cost model takes `mb_sum_l2`; the runtime computes it from the segment ids it
already holds, with the same skip rule as the kernel.
"""

from __future__ import annotations

import numpy as np

from resihp_jax.model.attention import computed_block_pairs


def mb_block_pair_l2(segment_ids_MxBxS: np.ndarray, block_size: int) -> np.ndarray:
    """[M] computed attention block pairs of each micro-batch, times block_size^2."""
    seg = np.asarray(segment_ids_MxBxS)
    return np.array([computed_block_pairs(seg[m], block_size) for m in range(seg.shape[0])],
                    dtype=np.float64) * float(block_size) ** 2
