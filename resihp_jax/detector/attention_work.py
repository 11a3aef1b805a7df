"""The attention feature the runtime hands the detector: what the kernel really computes.

The block-sparse attention skips (query block, key block) pairs that share no segment, so its
cost follows the computed block pairs, not sum l_i^2 (a document straddling a block boundary
costs whole blocks; a short document at least one); dense masked attention ('row') computes
every pair of the row whatever its documents.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from resihp_jax.errors import ConfigError
from resihp_jax.attention.kernels import computed_block_pairs
from resihp_jax.perfmodel.facts import ModelFacts

ATTENTION_COSTS = ("document", "row")


class _Batch(Protocol):
    @property
    def shape(self) -> tuple[int, int, int]: ...  # (micro-batches, rows, seq_len)

    def sum_sq_lengths(self) -> np.ndarray: ...


def mb_block_pair_l2(segment_ids_MxBxS: np.ndarray, block_size: int) -> np.ndarray:
    """[M] computed attention block pairs of each micro-batch, times block_size^2: in
    sum-l^2 units, to go wherever the cost model takes `mb_sum_l2`."""
    seg = np.asarray(segment_ids_MxBxS)
    return np.array([computed_block_pairs(seg[m], block_size) for m in range(seg.shape[0])],
                    dtype=np.float64) * float(block_size) ** 2


def mb_attention_l2(model: ModelFacts, batch: _Batch) -> np.ndarray:
    """[M] the l^2 feature of each micro-batch of `batch` (a GlobalBatch) as `model` computes
    attention: `batch.sum_sq_lengths()` for 'document', rows x seq_len^2 for 'row'."""
    cost = model.attention_cost
    if cost not in ATTENTION_COSTS:
        raise ConfigError(f"model {model.name!r}: attention_cost={cost!r}; valid are "
                          f"{', '.join(ATTENTION_COSTS)}")
    if cost == "row":
        n_mb, rows, seq_len = batch.shape
        return np.full(n_mb, float(rows * seq_len * seq_len))
    return np.asarray(batch.sum_sq_lengths(), dtype=np.float64)
