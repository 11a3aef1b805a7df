"""Host callbacks around each device's stage work, forward and backward, inside the step.

`Instrument` wraps a region of the per-device computation in two identity markers with
custom VJPs. Each marker calls a host function with scalar operands only (the device's mesh
coordinates, a per-device runtime `knob`, whether the tick is busy), in the forward pass and
again, mirrored, in the backward pass. The runtime uses it to time stages and to inject
fail-slow delays; the train step knows nothing of what the host function does.

Data dependencies order the calls: a marker's callback reads one element of its input and
its (zero) result is added to the output, so XLA can neither drop nor reorder it.
"""

from __future__ import annotations

from typing import Callable, Protocol

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

FWD_START, FWD_END, BWD_START, BWD_END = 0, 1, 2, 3


class HostFn(Protocol):
    def __call__(self, event: int, dp: int, pp: int, tp: int, knob: float, busy: bool,
                 tick: int) -> None: ...


def _call_host(host: HostFn, event: int, x: jax.Array, coords: tuple[jax.Array, ...]) -> jax.Array:
    def on_host(dep, dp, pp, tp, knob, busy, tick):  # noqa: ANN001 - numpy scalars from XLA
        del dep  # only orders the call after the values it depends on exist
        host(event, int(dp), int(pp), int(tp), float(knob), bool(busy), int(tick))
        return jnp.zeros((), jnp.float32)

    dep = jax.lax.stop_gradient(x.reshape(-1)[0].astype(jnp.float32))
    zero = io_callback(on_host, jax.ShapeDtypeStruct((), jnp.float32), dep, *coords,
                       ordered=False)
    return x + zero.astype(x.dtype)


def _marker(host: HostFn, fwd_event: int, bwd_event: int) -> Callable[..., jax.Array]:
    @jax.custom_vjp
    def mark(x: jax.Array, coords: tuple[jax.Array, ...]) -> jax.Array:
        return _call_host(host, fwd_event, x, coords)

    def fwd(x, coords):  # noqa: ANN001, ANN202
        return _call_host(host, fwd_event, x, coords), coords

    def bwd(coords, g):  # noqa: ANN001, ANN202
        zeros = jax.tree.map(lambda c: jnp.zeros_like(c, dtype=jax.dtypes.float0)
                             if jnp.issubdtype(c.dtype, jnp.integer) or c.dtype == bool
                             else jnp.zeros_like(c), coords)
        return _call_host(host, bwd_event, g, coords), zeros

    mark.defvjp(fwd, bwd)
    return mark


class Instrument:
    """Markers calling `host` at the start and end of a region, forward and backward."""

    def __init__(self, host: HostFn):
        self.host = host
        self.enter = _marker(host, FWD_START, BWD_END)
        self.exit = _marker(host, FWD_END, BWD_START)

    def coords(self, knob: jax.Array, busy: jax.Array, tick: jax.Array) -> tuple[jax.Array, ...]:
        axes = tuple(jax.lax.axis_index(a) for a in ("dp", "pp", "tp"))
        return (*axes, jax.lax.stop_gradient(knob), busy, tick)

