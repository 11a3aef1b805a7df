"""tokamax's kernels as a candidate (attention/tokamax.py): each token's document start, the
refusal where the package is missing, and, where it is installed, the same outputs and
gradients as the dense reference on packed rows, padding 0 and no leak between documents."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resihp_jax.attention import flash, tokamax
from resihp_jax.attention.kernels import dense_attention, segment_attention
from resihp_jax.errors import ConfigError


def test_each_token_sees_back_to_the_start_of_its_own_document() -> None:
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [4, 4, 4, 4, 4, 4, 4, 4]])
    np.testing.assert_array_equal(flash.document_bounds(seg)[1],
                                  [[0, 0, 0, 3, 3, 5, 6, 6], [0] * 8])


def test_a_missing_package_is_refused_in_one_line_naming_the_extra(monkeypatch) -> None:
    def missing():  # noqa: ANN202
        raise ImportError("No module named 'tokamax'")

    monkeypatch.setattr(tokamax, "_kernels", missing)
    q = jnp.zeros((1, 32, 2, 8))
    with pytest.raises(ConfigError, match=r"'tokamax': the tokamax package is not importable "
                       r"\(ImportError: No module named 'tokamax'\); pip install "
                       r"'resihp-jax\[gpu\]'; valid without it: auto"):
        segment_attention(q, q, q, jnp.ones((1, 32), jnp.int32), block_size=16,
                          implementation="tokamax")


def _rows() -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(0)
    b, s, h, g, k = 2, 64, 4, 2, 16
    q, kk, v = (jnp.asarray(rng.normal(size=(b, s, n, k)), jnp.float32) for n in (h, g, g))
    seg = np.zeros((b, s), np.int32)
    seg[0, :20], seg[0, 20:50], seg[1, :] = 1, 2, 1  # row 0 ends in padding
    return q, kk, v, jnp.asarray(seg)


def test_where_installed_it_equals_the_reference_and_never_leaks() -> None:
    pytest.importorskip("tokamax")
    if tokamax.unavailable():
        pytest.skip(tokamax.unavailable())
    q, k, v, seg = _rows()
    kernel = lambda *a: segment_attention(*a, block_size=16, implementation="tokamax")  # noqa
    out = kernel(q, k, v, seg)
    np.testing.assert_allclose(out, dense_attention(q, k, v, seg), atol=1e-5)
    assert float(jnp.max(jnp.abs(out[0, 50:]))) == 0.0  # padding outputs exactly 0
    moved = v.at[0, :20].add(1.0)  # the first document's values: the second must not move
    np.testing.assert_array_equal(kernel(q, k, moved, seg)[0, 20:50], out[0, 20:50])

    def grads(attention):  # noqa: ANN001, ANN202
        return jax.grad(lambda *a: jnp.sum(attention(*a, seg) ** 2), argnums=(0, 1, 2))(q, k, v)

    for got, want in zip(grads(kernel), grads(dense_attention)):
        np.testing.assert_allclose(got, want, atol=1e-4)
