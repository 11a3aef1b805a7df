"""cuDNN's packed layout takes each row's documents as offsets and lengths: they must describe
exactly the documents the segment ids hold (the kernel itself needs a GPU: the GPU suite's
kernels section checks it against the float32 reference)."""

import jax
import numpy as np
import pytest

from resihp_jax.attention.cudnn import document_spans, documents_per_row, packed_attention


def spans_from_runs(seg_S: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of each contiguous run of one nonzero id, by a plain loop."""
    out: list[tuple[int, int]] = []
    for i, value in enumerate(seg_S):
        if value == 0:
            continue
        if i == 0 or seg_S[i - 1] != value:
            out.append((i, 1))
        else:
            out[-1] = (out[-1][0], out[-1][1] + 1)
    return out


def test_offsets_and_lengths_are_the_rows_documents_then_minus_one():
    seg = np.zeros((3, 40), np.int32)
    seg[0] = np.repeat([1, 2, 3, 4], [10, 1, 20, 9])  # a one-token document
    seg[1, :25] = np.repeat([7, 2], [5, 20])  # trailing padding, ids out of order
    seg[2] = np.repeat(np.arange(1, 9), 5)  # exactly max_documents
    offsets, lengths = map(np.asarray, document_spans(jax.numpy.asarray(seg), 8))
    assert offsets.shape == (3, 9) and lengths.shape == (3, 8)
    for row in range(3):
        want = spans_from_runs(seg[row])
        n = len(want)
        assert [tuple(x) for x in zip(offsets[row, :n], lengths[row, :n])] == want
        assert (offsets[row, n:] == -1).all() and (lengths[row, n:] == -1).all()
    assert np.asarray(documents_per_row(jax.numpy.asarray(seg))).tolist() == [4, 2, 8]


def test_bad_bound_and_platform_without_cudnn_are_refused():
    seg = jax.numpy.ones((1, 8), np.int32)
    with pytest.raises(ValueError, match="max_documents=0"):
        document_spans(seg, 0)
    q = jax.numpy.zeros((1, 8, 2, 64), jax.numpy.bfloat16)
    if jax.default_backend() != "gpu":  # the caller falls back on any exception
        with pytest.raises(Exception):  # noqa: B017,PT011 - whatever JAX raises off GPUs
            jax.jit(lambda *a: packed_attention(*a, max_documents=1))(q, q, q, seg)
