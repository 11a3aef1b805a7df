"""Validation probes: time a compute kernel on each device and point-to-point transfers between
pipeline neighbours, then localize the slow device(s).

The probe is a small shard_map program on the plan's mesh. Its rounds run one device's kernel
at a time (a psum after each round is the barrier), so on shared host cores every device is
timed alone. Kernel and transfers are bracketed by the same Instrument markers as the train
step, so an injected fail-slow delay slows the probe exactly as it slows training.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from resihp_jax.errors import ConfigError
from resihp_jax.meshes.mesh import AXES, make_mesh, put_global
from resihp_jax.meshes.plan import Plan
from resihp_jax.train.instrument import FWD_END, FWD_START, Instrument, RegionTimer

LINK_TICK = 1 << 20  # ticks at or above this mark transfer rounds
# the wall-timed probe (a job of several processes): each device's program runs WALL_WORK x
# the kernel rounds of the callback-timed one, in WALL_PASSES round-robin passes (its time:
# the fastest pass). On 4 processes of 2 shared cores one pass of the plain rounds swung
# 0.6x-1.9x of the median on healthy devices.
WALL_WORK, WALL_PASSES = 2, 3
_SPEC = P(*AXES)


@dataclass(frozen=True)
class ProbeResult:
    compute_s: dict[int, float]  # device id -> fastest kernel time over the repeats
    link_s: dict[int, float]  # device id -> fastest neighbour-transfer time
    wall_s: float = 0.0  # how long the probe stalled training
    # device id -> the process (host) it belongs to, in a job of several processes
    hosts: dict[int, int] | None = None


@dataclass(frozen=True)
class Localization:
    devices: tuple[int, ...]
    kind: str  # 'compute' or 'link'
    slowdown: float
    confidence: float


def _outliers(times: dict[int, float], margin: float) -> tuple[list[int], float, float]:
    """Devices slower than the median by more than `margin` (relative), their factor, z."""
    ids = sorted(times)
    t = np.array([times[d] for d in ids])
    med = float(np.median(t))
    if med <= 0:
        return [], 1.0, 0.0
    ratio = t / med
    slow = [d for d, r in zip(ids, ratio) if r > 1.0 + margin]
    if not slow:
        return [], 1.0, 0.0
    # keep the ones near the worst (timing noise on shared cores adds small, spurious
    # excesses) and any twice the median (no noise does that to a median repeat: a host
    # slowed as a whole shows on its devices by unequal factors)
    top = float(ratio.max())
    slow = [d for d, r in zip(ids, ratio)
            if d in slow and (r - 1.0 >= 0.6 * (top - 1.0) or r >= 2.0)]
    rest = np.array([r for d, r in zip(ids, ratio) if d not in slow])
    spread = 1.4826 * float(np.median(np.abs(rest - np.median(rest)))) if rest.size else 0.0
    factor = float(np.median([times[d] for d in slow]) / np.median(rest * med)) \
        if rest.size else float(ratio.max())
    z = (factor - 1.0) / max(spread, 0.02)
    return slow, factor, z


def _with_host_peers(slow: list[int], times: dict[int, float], hosts: dict[int, int] | None,
                     margin: float) -> list[int]:
    """`slow` and every other device of the same hosts that is slower than the median by
    more than `margin` too. A slow host (a throttled process, a hot node) slows all its
    devices by unequal factors, and the `_outliers` cut near the worst can leave one of them
    out; a plan that dropped only the named one would keep the host and cut a healthy one."""
    if not slow or not hosts:
        return slow
    med = float(np.median(list(times.values())))
    named = {hosts.get(d) for d in slow} - {None}
    peers = [d for d, t in times.items() if d not in slow and hosts.get(d) in named
             and t > (1.0 + margin) * med]
    return sorted(slow + peers)


def localize(result: ProbeResult, margin: float = 0.12) -> Localization | None:
    """Compute outliers first (they also slow their transfers); else link outliers."""
    if not result.compute_s:
        raise ConfigError("ProbeResult.compute_s is empty: the probe timed no device")
    for kind, times in (("compute", result.compute_s), ("link", result.link_s)):
        if not times:
            continue
        slow, factor, z = _outliers(times, margin)
        slow = _with_host_peers(slow, times, result.hosts, margin)
        if slow and len(slow) <= len(times) // 2:
            confidence = float(1.0 - math.exp(-max(z, 0.0) / 3.0))
            return Localization(tuple(slow), kind, factor, round(confidence, 4))
    return None


class _ProbeTimer:
    """Host function recording each device's busy interval per round."""

    def __init__(self, grid_DxPxT: np.ndarray) -> None:
        self.grid = grid_DxPxT
        self.regions = RegionTimer()
        self.samples: dict[tuple[int, int, int, int], float] = {}

    def __call__(self, event: int, dp: int, pp: int, tp: int, knob: float, busy: bool,
                 tick: int) -> None:
        if not busy:
            return
        key = (dp, pp, tp, tick)
        if event == FWD_START:
            self.regions.start(key)
        elif event == FWD_END:
            elapsed = self.regions.stop(key)
            if elapsed is not None:
                self.samples[key] = elapsed

    def collect(self) -> tuple[dict[int, float], dict[int, float]]:
        comp: dict[int, list[float]] = {}
        link: dict[int, list[float]] = {}
        for (dp, pp, tp, tick), dt in self.samples.items():
            dev = int(self.grid[dp, pp, tp])
            (link if tick >= LINK_TICK else comp).setdefault(dev, []).append(dt)
        # the median repeat: not the fastest, which a device throttled in bursts (a CPU
        # quota, a power cap) escapes whenever one repeat fits between its stalls
        typical = lambda d: {k: float(np.median(v)) for k, v in d.items()}  # noqa: E731
        return typical(comp), typical(link)


class Prober:
    """Compiled probe for one plan's mesh. `run(knobs_DxPxT)` -> ProbeResult."""

    def __init__(self, plan: Plan, devices: Sequence[jax.Device],
                 host: Callable[..., None] | None = None, *, size: int = 256,
                 iters: int = 8, repeats: int = 5, link_bytes: int = 1 << 18) -> None:
        self.plan, self.repeats = plan, repeats
        self._fn: Callable | None = None
        self._one_ran = False
        if plan.n_devices == 1:
            return  # nothing to compare one device with: `run` builds and times nothing
        self.mesh = make_mesh(plan, devices)
        self._timer = _ProbeTimer(plan.device_grid())
        timer = self._timer

        def both(*args: object) -> None:  # the fault host first: its delay is timed
            if host is not None:
                host(*args)
            timer(*args)

        inst = Instrument(both)
        n_dev, pp = plan.n_devices, plan.pp
        n_link = max(link_bytes // 4, 1)

        def body(x_NxN, buf_L, knob):
            x_NxN, buf_L, knob = x_NxN[0, 0, 0], buf_L[0, 0, 0], knob.reshape(())
            me = (jax.lax.axis_index("dp") * pp + jax.lax.axis_index("pp")) \
                * plan.tp + jax.lax.axis_index("tp")

            def kernel(y):
                return jax.lax.fori_loop(0, iters, lambda _, a: jnp.tanh(a @ a) * 0.5, y)

            def round_(carry, r):
                y, buf = carry
                busy = me == (r % n_dev)
                coords = inst.coords(knob, busy, r)
                y = inst.exit(jax.lax.cond(busy, kernel, lambda a: a,
                                           inst.enter(y, coords)), coords)
                barrier = jax.lax.psum(y[0, 0] * 0.0, AXES)
                return (y + barrier, buf), None

            def link_round(carry, r):
                y, buf = carry
                coords = inst.coords(knob, jnp.bool_(True), LINK_TICK + r)
                sent = inst.enter(buf, coords)
                if pp > 1:  # a ring over the pipeline: every device sends and receives once
                    sent = jax.lax.ppermute(sent, "pp", [(s, (s + 1) % pp) for s in range(pp)])
                buf = inst.exit(sent, coords)
                return (y + jax.lax.psum(buf[0] * 0.0, AXES), buf), None

            carry = (x_NxN, buf_L)
            carry, _ = jax.lax.scan(round_, carry, jnp.arange(n_dev * repeats))
            carry, _ = jax.lax.scan(link_round, carry, jnp.arange(repeats))
            return carry[0][None, None, None, :1, :1]

        def one_body(x_NxN, knob, who):  # only device `who` runs its kernel, `repeats` times
            x_NxN, knob, who = x_NxN[0, 0, 0], knob.reshape(()), who.reshape(())
            me = (jax.lax.axis_index("dp") * pp + jax.lax.axis_index("pp")) \
                * plan.tp + jax.lax.axis_index("tp")
            busy = me == who
            coords = inst.coords(knob, busy, 0)  # one region: an injected delay acts once

            def work(a):
                return jax.lax.fori_loop(0, WALL_WORK * iters * repeats,
                                         lambda _, b: jnp.tanh(b @ b) * 0.5, a)

            y = inst.exit(jax.lax.cond(busy, work, lambda a: a, inst.enter(x_NxN, coords)),
                          coords)
            # one barrier at the end: the program ends when the busy device is done
            return (y + jax.lax.psum(y[0, 0] * 0.0, AXES))[None, None, None, :1, :1]

        fn = jax.shard_map(body, mesh=self.mesh, in_specs=(_SPEC, _SPEC, _SPEC),
                           out_specs=_SPEC, check_vma=False)
        self._fn = jax.jit(fn)
        self._one = jax.jit(jax.shard_map(one_body, mesh=self.mesh,
                                          in_specs=(_SPEC, _SPEC, _SPEC), out_specs=_SPEC,
                                          check_vma=False))
        shard = NamedSharding(self.mesh, _SPEC)
        shape = (plan.dp, plan.pp, plan.tp)
        rng = np.random.default_rng(0)
        self._x = put_global(rng.standard_normal(shape + (size, size), np.float32)
                                 / math.sqrt(size), shard)
        self._buf = put_global(np.ones(shape + (n_link,), np.float32), shard)
        self._shard = shard

    def run(self, knobs_DxPxT: np.ndarray | None = None) -> ProbeResult:
        if self._fn is None:  # one device: it stands out from no median (`localize`: None)
            return ProbeResult({int(self.plan.device_ids[0]): 0.0}, {}, 0.0)
        if knobs_DxPxT is None:
            knobs_DxPxT = np.ones((self.plan.dp, self.plan.pp, self.plan.tp), np.float32)
        knobs = put_global(np.asarray(knobs_DxPxT, np.float32), self._shard)
        self._timer.regions.clear()
        self._timer.samples.clear()
        t0 = time.perf_counter()
        jax.block_until_ready(self._fn(self._x, self._buf, knobs))
        comp, link = self._timer.collect()
        if jax.process_count() > 1:
            comp = self._walled(knobs)
        return ProbeResult(comp, link, time.perf_counter() - t0)

    def _walled(self, knobs: jax.Array) -> dict[int, float]:
        """Each device's kernel rounds timed by the wall time of a program in which it alone
        runs them, less that of one in which nobody does. In a job of several processes the
        host callbacks' clocks are read by each process's Python, which its other threads
        (background compiles, checkpoint writes) can hold off for tens of milliseconds: on
        4 processes of 2 shared cores they made the same healthy processes' devices look
        2.4x to 5x slow in every run. The wall time of a whole collective program is the
        same on every process and stretches only with the devices' own work."""
        shape = (self.plan.dp, self.plan.pp, self.plan.tp)
        if not self._one_ran:  # compiled (and run once) before anything is timed
            nobody = put_global(np.full(shape, -1, np.int32), self._shard)
            jax.block_until_ready(self._one(self._x, knobs, nobody))
            self._one_ran = True
        n = self.plan.n_devices
        walls = np.full((WALL_PASSES, n + 1), np.inf)
        for k in range(WALL_PASSES):  # round-robin passes: a passing burst hits one of them
            for who in range(-1, n):
                chosen = put_global(np.full(shape, who, np.int32), self._shard)
                t0 = time.perf_counter()
                jax.block_until_ready(self._one(self._x, knobs, chosen))
                walls[k, who + 1] = time.perf_counter() - t0
        fastest = walls.min(axis=0)
        idle, grid = fastest[0], self.plan.device_grid().ravel()
        # less the program's own cost (dispatch, the barrier), never below a quarter of the
        # device's wall: a noisy idle program must not make a device's time vanish
        return {int(grid[i]): max(w - idle, 0.25 * w) / (WALL_WORK * self.repeats)
                for i, w in enumerate(fastest[1:])}


def gathered_probe(result: ProbeResult, device_ids: tuple[int, ...]) -> ProbeResult:
    """`result` completed with every other process's devices: in a job of several processes
    each process's callbacks time only its own devices."""
    from resihp_jax.meshes.agree import max_over_processes  # noqa: PLC0415

    ids = list(device_ids)
    local = np.array([[result.compute_s.get(d, 0.0) for d in ids],
                      [result.link_s.get(d, 0.0) for d in ids]] + [[result.wall_s] * len(ids)])
    both = max_over_processes(local)
    compute = {d: float(t) for d, t in zip(ids, both[0]) if t > 0}
    link = {d: float(t) for d, t in zip(ids, both[1]) if t > 0}
    hosts = {int(d.id): int(d.process_index) for d in jax.devices() if int(d.id) in ids}
    return ProbeResult(compute, link, float(both[2].max()), hosts)
