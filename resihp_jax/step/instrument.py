"""Host callbacks around each device's stage work, forward and backward, inside the step.

`Instrument` wraps a region of the per-device computation in two identity markers with
custom VJPs, each of which may call a host function with scalars (mesh coordinates, the
device's runtime `knob`, busy, tick), forward and, mirrored, backward: the runtime times
stages and injects fail-slow delays with it.

A host callback is far from free (on XLA:CPU each one stalls the device's thread for a
Python call, about 0.7 ms with 8 fake devices on 2 cores), so the markers call the host:
- forward, on a busy tick the caller marks `timed` (the train step times one micro-batch
  per stage and step), when the device's knob is not `OFF`;
- forward and backward, on every busy tick of a device whose knob is a slowdown (> 1), so
  an injected fault acts on all of that device's work.
Backward busy time is not timed: it is the forward time times a ratio the cost model knows.

Data dependencies order the calls: a marker's callback reads one element of its input and
its (zero) result is added to the output, so XLA can neither drop nor reorder it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Hashable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from resihp_jax.meshes.mesh import AXES

if TYPE_CHECKING:
    from resihp_jax.plan import Plan

FWD_START, FWD_END, BWD_START, BWD_END = 0, 1, 2, 3
OFF = 0.0  # knob value: no host calls on this device for this step (unless it is slowed)


class HostFn(Protocol):
    def __call__(self, event: int, dp: int, pp: int, tp: int, knob: float, busy: bool,
                 tick: int) -> None: ...


class Coords(NamedTuple):
    """Scalars a marker needs: what the host gets, plus whether this tick is timed."""
    dp: jax.Array
    pp: jax.Array
    tp: jax.Array
    knob: jax.Array
    busy: jax.Array
    tick: jax.Array
    timed: jax.Array


def _call_host(host: HostFn, event: int, x: jax.Array, coords: Coords,
               backward: bool) -> jax.Array:
    def on_host(dep, dp, pp, tp, knob, busy, tick):  # noqa: ANN001 - numpy scalars from XLA
        del dep  # only orders the call after the values it depends on exist
        host(event, int(dp), int(pp), int(tp), float(knob), bool(busy), int(tick))
        # numpy, not jnp: a JAX op here is compiled at a process's first step (its critical
        # path after a relaunch) and dispatched on every call
        return np.zeros((), np.float32)

    def call(dep: jax.Array, *operands: jax.Array) -> jax.Array:
        return io_callback(on_host, jax.ShapeDtypeStruct((), jnp.float32), dep, *operands,
                           ordered=False)

    def skip(dep: jax.Array, *operands: jax.Array) -> jax.Array:
        return jnp.zeros((), jnp.float32)

    slowed = coords.knob > 1.0
    if backward:
        calls = coords.busy & slowed
    else:
        calls = coords.busy & (coords.knob != OFF) & (coords.timed | slowed)
    dep = jax.lax.stop_gradient(x.reshape(-1)[0].astype(jnp.float32))
    zero = jax.lax.cond(calls, call, skip, dep, *coords[:6])
    return x + zero.astype(x.dtype)


def _marker(host: HostFn, fwd_event: int, bwd_event: int) -> Callable[..., jax.Array]:
    @jax.custom_vjp
    def mark(x: jax.Array, coords: Coords) -> jax.Array:
        return _call_host(host, fwd_event, x, coords, backward=False)

    def fwd(x, coords):  # noqa: ANN001, ANN202
        return mark(x, coords), coords

    def bwd(coords, g):  # noqa: ANN001, ANN202
        zeros = jax.tree.map(lambda c: jnp.zeros_like(c, dtype=jax.dtypes.float0)
                             if jnp.issubdtype(c.dtype, jnp.integer) or c.dtype == bool
                             else jnp.zeros_like(c), coords)
        return _call_host(host, bwd_event, g, coords, backward=True), zeros

    mark.defvjp(fwd, bwd)
    return mark


class Instrument:
    """Markers calling `host` at the start and end of a region, forward and backward."""

    def __init__(self, host: HostFn):
        self.host = host
        self.enter = _marker(host, FWD_START, BWD_END)
        self.exit = _marker(host, FWD_END, BWD_START)

    def coords(self, knob: jax.Array, busy: jax.Array, tick: jax.Array,
               timed: jax.Array | bool = True) -> Coords:
        axes = tuple(jax.lax.axis_index(a) for a in AXES)
        return Coords(*axes, jax.lax.stop_gradient(knob), busy, tick, jnp.asarray(timed))


class RegionTimer:
    """The host side of the markers: when each open region (keyed, e.g. by device
    coordinates) started, and how long it lasted when it closes. Each key has one writer,
    its device's own callback thread, so no lock is needed."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._open: dict[Hashable, float] = {}

    def start(self, key: Hashable) -> None:
        self._open[key] = self.clock()

    def stop(self, key: Hashable) -> float | None:
        """Seconds since `start(key)`, or None if the region was never opened."""
        began = self._open.pop(key, None)
        return None if began is None else self.clock() - began

    def open_keys(self) -> list[Hashable]:
        """Regions started and not stopped (work still running, or hung)."""
        return list(self._open)

    def clear(self) -> None:
        self._open.clear()


class FaultHook(Protocol):
    """A fault source: an Instrument host function, per-device knobs for a step (raising
    for a dead device), and the same faults seen through another plan's mesh."""

    def __call__(self, event: int, dp: int, pp: int, tp: int, knob: float, busy: bool,
                 tick: int) -> None: ...

    def knobs(self, step: int) -> np.ndarray: ...

    def with_plan(self, plan: Plan) -> FaultHook: ...


def chain_hosts(*hosts: Callable[..., None] | None) -> Callable[..., None]:
    """One host function calling each given one in order (put the injector before timers, so
    end-of-work timestamps include the injected delay)."""
    live = tuple(h for h in hosts if h is not None)

    def host(event: int, dp: int, pp: int, tp: int, knob: float, busy: bool, tick: int) -> None:
        for fn in live:
            fn(event, dp, pp, tp, knob, busy, tick)

    return host
