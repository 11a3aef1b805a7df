"""Validation probes: time a compute kernel on each device and point-to-point transfers between
pipeline neighbours, then localize the slow device(s).

In one process a shard_map program on the plan's mesh runs one device's kernel a round (a
psum after each is the barrier), so on shared cores every device is timed alone, by host
callbacks; a job of several processes times compute only, locally (`_LocalProbe`). The same
Instrument markers as the train step bracket the work: an injected delay slows it alike.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from resihp_jax.errors import ConfigError
from resihp_jax.meshes.mesh import AXES, make_mesh, put_global
from resihp_jax.plan import Plan
from resihp_jax.step.instrument import FWD_END, FWD_START, Coords, Instrument, RegionTimer

LINK_TICK = 1 << 20  # ticks at or above this mark transfer rounds
# the locally timed probe (a job of several processes, `_LocalProbe`): each device works for
# a window of LOCAL_TARGET_S (per platform; else the default) in runs of at first
# LOCAL_TRIAL kernel iterations; the fastest of LOCAL_PASSES passes counts. On XLA:CPU runs
# of a few milliseconds read 0.2x-14x of the median on healthy processes (4 of them on 2
# shared cores); a GPU's kernels keep time to a few percent over milliseconds
LOCAL_TARGET_S, LOCAL_TARGET_DEFAULT_S = {"cpu": 0.05}, 0.01
# ... and its kernel's matrices are this small on XLA:CPU (else the `size` of the mesh
# probe): a larger matmul is split over the process's thread pool, whose threads wait for
# each other at every one, and on oversubscribed shared cores one descheduled thread held a
# healthy device's whole run up (0.5x-3.7x of the median with nothing else running)
LOCAL_SIZE = {"cpu": 64}
GIL_SWITCH_S = 0.0005  # the interpreter's switch interval while it runs (`_LocalProbe.times`)
LOCAL_PASSES, LOCAL_TRIAL = 2, 4
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
        if plan.n_devices == 1:
            return  # nothing to compare one device with: `run` builds and times nothing
        self.mesh = make_mesh(plan, devices)
        self._timer = timer = _ProbeTimer(plan.device_grid())

        def both(*args: object) -> None:  # the fault host first: its delay is timed
            if host is not None:
                host(*args)
            timer(*args)

        inst = Instrument(both)
        n_dev, pp = plan.n_devices, plan.pp
        n_link = max(link_bytes // 4, 1)
        # a job of several processes times compute locally (`_LocalProbe`) and no transfers:
        # callbacks there read each process's own clock, which its other threads hold off
        # for tens of milliseconds (healthy processes' devices read 2.4x-5x slow), and a
        # transfer's time is all latency, no work to average that over
        self._several = jax.process_count() > 1
        compute_rounds = n_dev * repeats

        def kernel(y, n):
            return jax.lax.fori_loop(0, n, lambda _, a: jnp.tanh(a @ a) * 0.5, y)

        def body(x_NxN, buf_L, knob):
            x_NxN, buf_L, knob = x_NxN[0, 0, 0], buf_L[0, 0, 0], knob.reshape(())
            me = (jax.lax.axis_index("dp") * pp + jax.lax.axis_index("pp")) \
                * plan.tp + jax.lax.axis_index("tp")

            def round_(carry, r):
                y, buf = carry
                busy = me == (r % n_dev)
                coords = inst.coords(knob, busy, r)
                y = inst.exit(jax.lax.cond(busy, lambda a: kernel(a, iters), lambda a: a,
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
            carry, _ = jax.lax.scan(round_, carry, jnp.arange(compute_rounds))
            carry, _ = jax.lax.scan(link_round, carry, jnp.arange(repeats))
            return carry[0][None, None, None, :1, :1]

        fn = jax.shard_map(body, mesh=self.mesh, in_specs=(_SPEC, _SPEC, _SPEC),
                           out_specs=_SPEC, check_vma=False)
        self._fn = jax.jit(fn)
        shard = NamedSharding(self.mesh, _SPEC)
        shape = (plan.dp, plan.pp, plan.tp)
        rng = np.random.default_rng(0)
        x_host = rng.standard_normal(shape + (size, size), np.float32) / math.sqrt(size)
        self._x = put_global(x_host, shard)
        self._buf = put_global(np.ones(shape + (n_link,), np.float32), shard)
        self._shard = shard
        if self._several:
            platform = self.mesh.devices.flat[0].platform
            local_size = LOCAL_SIZE.get(platform, size)
            x_local = rng.standard_normal((local_size,) * 2, np.float32) / math.sqrt(local_size)
            self._local = _LocalProbe(plan, x_local, inst,
                                      lambda a: jnp.tanh(a @ a) * 0.5,
                                      LOCAL_TARGET_S.get(platform, LOCAL_TARGET_DEFAULT_S))
            self._barrier = jax.jit(jax.shard_map(
                lambda y: y + jax.lax.psum(y * 0.0, AXES), mesh=self.mesh, in_specs=_SPEC,
                out_specs=_SPEC, check_vma=False))
            self._zero = put_global(np.zeros(shape, np.float32), shard)

    def run(self, knobs_DxPxT: np.ndarray | None = None) -> ProbeResult:
        if self._fn is None:  # one device: it stands out from no median (`localize`: None)
            return ProbeResult({int(self.plan.device_ids[0]): 0.0}, {}, 0.0)
        if knobs_DxPxT is None:
            knobs_DxPxT = np.ones((self.plan.dp, self.plan.pp, self.plan.tp), np.float32)
        if self._several:
            self._local.prepare()  # compiles once: not a cost of the run (`wall_s`)
        t0 = time.perf_counter()
        if self._several:  # compute only: see `_LocalProbe` (and transfers below)
            comp = self._local.times(np.asarray(knobs_DxPxT, np.float32), self._synced)
            return ProbeResult(comp, {}, time.perf_counter() - t0)
        knobs = put_global(np.asarray(knobs_DxPxT, np.float32), self._shard)
        self._timer.regions.clear()
        self._timer.samples.clear()
        jax.block_until_ready(self._fn(self._x, self._buf, knobs))
        comp, link = self._timer.collect()
        return ProbeResult(comp, link, time.perf_counter() - t0)

    def _synced(self) -> None:
        """Every process of the job here: the next pass starts within a collective's
        latency in all of them."""
        jax.block_until_ready(self._barrier(self._zero))


class _LocalProbe:
    """Each of this process's devices timed alone in a program of its own, by this process's
    clock, while every other process times its devices the same way at the same moment.

    Not one collective program per device: a held-up process stalls every collective program
    it takes part in, lengthening its peers' times as much as its own (a process slowed 3x
    read 1.1x-1.3x on 4 processes of 2 shared cores). With all processes working at once,
    load from elsewhere falls on all alike. Each device works for a window of about
    `target_s` (`_window`) and its rate counts: every process stays busy as long, so the load
    on shared cores stays even (with a fixed amount of work the healthy ones finish first and
    leave a slow one the cores: a 3x process read 2x), and the window is long against a
    process's clock delays (a thread holding the interpreter) and a throttle's period."""

    def __init__(self, plan: Plan, x_NxN: np.ndarray, inst: Instrument,
                 step: Callable[[jax.Array], jax.Array], target_s: float) -> None:
        self.plan, self.target_s = plan, target_s

        def program(x_NxN, knob, n, dp, pp, tp):
            # one marked region, untimed (the clock is this process's own): it calls the host
            # only where the device is slowed, so an injected delay acts on the probe's work
            coords = Coords(dp, pp, tp, knob, jnp.bool_(True), jnp.int32(0), jnp.bool_(False))
            y = jax.lax.fori_loop(0, n, lambda _, a: step(a), inst.enter(x_NxN, coords))
            return inst.exit(y, coords)[:1, :1]

        self._program = jax.jit(program)
        grid = plan.device_grid()
        local = {int(d.id): d for d in jax.local_devices()}
        # (device id, its device, its mesh coordinates) of every plan device held here
        self.mine = [(int(grid[c]), local[int(grid[c])], c) for c in np.ndindex(grid.shape)
                     if int(grid[c]) in local]
        self._x = {dev: jax.device_put(x_NxN, device) for dev, device, _ in self.mine}
        self._coords = {dev: [jax.device_put(np.int32(c), device) for c in coords]
                        for dev, device, coords in self.mine}
        self.k = LOCAL_TRIAL  # kernel iterations a run (grown to the window: `_window`)
        self._ran = False

    def _run(self, dev: int, device: jax.Device, knob: jax.Array, n: int) -> None:
        n_ = jax.device_put(np.int32(n), device)
        jax.block_until_ready(self._program(self._x[dev], knob, n_, *self._coords[dev]))

    def _window(self, dev: int, device: jax.Device, knob: float) -> float:
        """Seconds per kernel iteration over a window of about `target_s` of runs: each run
        `self.k` iterations, doubled while a run is short against the window (its dispatch
        would count), halved while one is long (the window would overrun)."""
        knob_ = jax.device_put(np.float32(knob), device)
        k, done = self.k, 0
        start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            self._run(dev, device, knob_, k)
            now, done = time.perf_counter(), done + k
            if now - start >= self.target_s:
                break
            took = now - t0
            if took < self.target_s / 40 and k < 1 << 20:
                k *= 2
            elif took > self.target_s / 8 and k > 1:
                k //= 2
        self.k = k
        return (now - start) / done

    def prepare(self) -> None:
        """Compile the program for each device (its own placement) and run it once."""
        if not self._ran:
            for dev, device, _ in self.mine:
                self._run(dev, device, jax.device_put(np.float32(1.0), device), 1)
            self._ran = True

    def times(self, knobs_DxPxT: np.ndarray, synced: Callable[[], None]) -> dict[int, float]:
        """Device id -> seconds one kernel iteration takes (fastest of LOCAL_PASSES passes)."""
        self.prepare()
        fastest = {dev: math.inf for dev, _, _ in self.mine}
        # the interpreter hands its lock over every GIL_SWITCH_S while the probe runs: each
        # run's dispatch and return wait for it, and a thread of this process tracing a
        # background compile holds it for up to the default 5 ms each time, which made a
        # healthy process's devices read slow in every run of a check
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, GIL_SWITCH_S))
        try:
            for _ in range(LOCAL_PASSES):
                synced()
                for dev, device, coords in self.mine:
                    fastest[dev] = min(fastest[dev],
                                       self._window(dev, device, float(knobs_DxPxT[coords])))
        finally:
            sys.setswitchinterval(switch)
        return fastest


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
