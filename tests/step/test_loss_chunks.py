"""The head and loss in token chunks: how many, and that each chunk sees its own slice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resihp_jax.errors import ConfigError
from resihp_jax.step.body import (LOGITS_CHUNK_BYTES, from_token_chunks, head_chunks,
                                  over_token_chunks)
from resihp_jax.step.config import StepConfig

LLAMA3_VOCAB = 128_256


def test_auto_keeps_small_logits_whole_and_chunks_large_ones_within_the_cap() -> None:
    assert head_chunks("auto", 4, 2048, 256) == 1  # tiny's vocabulary
    assert head_chunks("auto", 4, 2048, LLAMA3_VOCAB) == 1  # 4.2 GB
    assert head_chunks("auto", 16, 2048, 32_000) == 1  # the llama-1b preset at 32k tokens
    chunks = head_chunks("auto", 16, 2048, LLAMA3_VOCAB)  # 32,768 tokens: 16.8 GB
    assert chunks == 4 and 16 * 2048 // chunks * LLAMA3_VOCAB * 4 <= LOGITS_CHUNK_BYTES
    assert 2048 % head_chunks("auto", 64, 2048, LLAMA3_VOCAB) == 0
    assert head_chunks(8, 1, 64, 10) == 8  # as given


def test_a_chunk_count_that_does_not_divide_the_sequence_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="loss_chunks=3: must divide the sequence length 64"):
        head_chunks(3, 2, 64, 256)
    for bad in (0, -2, 1.5, True, "many"):
        with pytest.raises(ConfigError, match="loss_chunks="):
            StepConfig(loss_chunks=bad)


def test_each_chunk_sees_its_slice_of_the_sequence_and_the_results_come_back_in_order() -> None:
    x_BxSxD = jnp.arange(2 * 8 * 3, dtype=jnp.float32).reshape(2, 8, 3)
    t_BxS = jnp.arange(16).reshape(2, 8)
    seen = []

    def per_token(x_BxCxD: jax.Array, t_BxC: jax.Array) -> jax.Array:
        seen.append(x_BxCxD.shape)
        return x_BxCxD.sum(-1) + t_BxC

    out = from_token_chunks(over_token_chunks(per_token, 4, x_BxSxD, t_BxS))
    assert seen == [(2, 2, 3)]  # traced once, on a quarter of the sequence
    np.testing.assert_array_equal(out, x_BxSxD.sum(-1) + t_BxS)
    # and their gradient is the whole one's
    whole = jax.grad(lambda x: jnp.sum(per_token(x, t_BxS) ** 2))(x_BxSxD)
    chunked = jax.grad(lambda x: jnp.sum(over_token_chunks(
        lambda xc, tc: jnp.sum(per_token(xc, tc) ** 2), 4, x, t_BxS)))(x_BxSxD)
    np.testing.assert_allclose(chunked, whole, rtol=1e-6)
