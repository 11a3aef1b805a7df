"""Host buffers reserved ahead of a move: zeroed, within the budget, each used once."""

from __future__ import annotations

import jax
import numpy as np

from resihp_jax.step.staging import HostStaging


def _shapes(*shapes: tuple[int, ...]) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(s, np.float32) for s in shapes]


def test_reserved_buffers_are_zeroed_and_taken_once() -> None:
    staging = HostStaging(budget_bytes=10_000)
    assert staging.reserve(_shapes((10, 10), (10, 10), (5,))) == 4 * (100 + 100 + 5)
    assert staging.reserve(_shapes((10, 10))) == 0  # held already
    first = staging.take((10, 10), np.float32)
    assert first.shape == (10, 10) and not first.any()
    second = staging.take((10, 10), np.float32)
    assert second is not first
    assert staging.held_bytes == 4 * 5
    third = staging.take((10, 10), np.float32)  # none left: a fresh zeroed one
    assert third.shape == (10, 10) and not third.any()


def test_the_budget_caps_what_is_held() -> None:
    staging = HostStaging(budget_bytes=4 * 150)
    assert staging.reserve(_shapes((100,), (100,))) == 4 * 100
    assert staging.held_bytes == 4 * 100
    staging.clear()
    assert staging.held_bytes == 0


def test_dtypes_are_told_apart() -> None:
    import jax.numpy as jnp

    staging = HostStaging(budget_bytes=1000)
    staging.reserve([jax.ShapeDtypeStruct((4,), jnp.bfloat16)])
    assert staging.take((4,), np.float32).dtype == np.float32
    assert staging.held_bytes == 8
    assert staging.take((4,), jnp.bfloat16).dtype == jnp.bfloat16
    assert staging.held_bytes == 0


def test_buffers_start_on_the_boundary_xla_adopts_without_a_copy() -> None:
    import jax.numpy as jnp

    from resihp_jax.step.staging import ALIGN

    staging = HostStaging(budget_bytes=1 << 20)
    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in (((3, 5), np.float32), ((7,), jnp.bfloat16),
                                                    ((1,), np.int32))]
    staging.reserve(shapes)
    for shape in shapes:
        held = staging.take(shape.shape, shape.dtype)  # reserved
        fresh = staging.take(shape.shape, shape.dtype)  # none left: made now
        for buf in (held, fresh):
            assert buf.ctypes.data % ALIGN == 0 and buf.shape == shape.shape
            assert buf.dtype == shape.dtype and not buf.any()
