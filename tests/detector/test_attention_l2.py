"""The detector's attention feature follows how the model's attention cost grows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from resihp_jax.detector.attention_work import mb_attention_l2
from resihp_jax.errors import ConfigError
from resihp_jax.models.config import get_model_config
from tests.helpers import make_batches


@dataclass(frozen=True)
class Facts:
    attention_cost: str
    name: str = "user-model"


def test_per_document_for_our_kernel_and_per_row_for_dense_attention() -> None:
    batch = make_batches(4, microbatch_size=2, seq_len=64)[0]
    per_document = mb_attention_l2(get_model_config("tiny"), batch)
    np.testing.assert_array_equal(per_document, batch.sum_sq_lengths())
    np.testing.assert_array_equal(mb_attention_l2(Facts("row"), batch), np.full(4, 2 * 64**2))
    assert (per_document < 2 * 64**2).all()  # packed documents cost less than whole rows
    with pytest.raises(ConfigError, match="attention_cost='quadratic'; valid are"):
        mb_attention_l2(Facts("quadratic"), batch)
