"""The event-driven simulation: one policy through one trace, throughput piecewise constant
between events (fail-stop, replacement, fail-slow start and end, and the policy's own
detections, clearances, deferred switches and timers), stalls taken out of the timeline.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass

import numpy as np

from resihp_jax.errors import ConfigError
from resihp_jax.sim.cluster import ClusterModel
from resihp_jax.sim.resihp import Ours, OursHeteroTP
from resihp_jax.sim.peers import CheckpointRestart, FtHsdp, Greyhound, Malleus, Oobleck, ReCycle
from resihp_jax.sim.policy import Live, SimPolicy
from resihp_jax.sim.replicas import OursReplicas
from resihp_jax.sim.traces import Trace

POLICIES: dict[str, type[SimPolicy]] = {cls.name: cls for cls in (
    Ours, OursHeteroTP, OursReplicas, CheckpointRestart, FtHsdp, Oobleck, ReCycle, Greyhound,
    Malleus)}
OURS = Ours.name
STOP, REPLACE, SLOW_START, SLOW_END, DETECT, CLEAR, READY, WAKE = range(8)


@dataclass(frozen=True)
class RunResult:
    policy: str
    goodput: float  # trained tokens / (reference rate * duration)
    running_throughput: float  # mean rate while not stalled, of the reference
    stall_s_per_failure: float  # fail-stop stall (detection, recovery, lost work); nan: none
    n_failures: int
    false_alarms: float  # expected alarms over the steps run
    false_alarm_stall_s: float
    switch_stall_s: float  # re-plans after fail-slow verdicts and rejoins
    segments: np.ndarray  # [K, 3] productive (start, end, rate), when recorded


class _Clock:
    """Integrates the rate between events; a stall pushes back when training resumes."""

    def __init__(self) -> None:
        self.t, self.resume, self.tokens, self.running, self.rate = 0.0, 0.0, 0.0, 0.0, 0.0
        self.segments: list[tuple[float, float, float]] = []

    def advance(self, t: float) -> None:
        start = max(self.t, self.resume)
        if t > start:
            self.tokens += self.rate * (t - start)
            self.running += t - start
            self.segments.append((start, t, self.rate))
        self.t = max(self.t, t)

    def stall(self, t: float, seconds: float) -> float:
        """Stall from t; returns the stall time it added."""
        if seconds <= 0:
            return 0.0
        before = max(self.resume, t)
        self.resume = max(self.resume, t + seconds)
        return self.resume - before


def _trace_events(trace: Trace) -> list[tuple[float, int, int]]:
    events = [(float(t), STOP, i) for i, t in enumerate(trace.stop_t_F)]
    events += [(float(t), REPLACE, i) for i, t in enumerate(trace.replace_t_F)]
    events += [(float(t), SLOW_START, e) for e, t in enumerate(trace.slow_t_E)]
    events += [(float(t), SLOW_END, e) for e, t in enumerate(trace.slow_end_E)]
    return sorted(e for e in events if e[0] < trace.duration_s)


class _Run:
    """State of one policy through one trace."""

    def __init__(self, policy: SimPolicy, trace: Trace, seed: int) -> None:
        self.policy, self.trace, self.live = policy, trace, policy.live
        self.rng = np.random.default_rng(seed + 7919)  # detection draws, apart from the trace
        self.clock = _Clock()
        self.active: dict[int, int] = {}  # slow GPU -> its episode
        self.pending: list[tuple[float, int, int, int]] = []  # (t, kind, device, episode)
        self.stop_stall = self.switch_stall = 0.0
        self.n_stops = 0

    def apply(self, t: float, kind: int, index: int) -> None:
        stall, is_stop = self._handle(t, kind, index)
        added = self.clock.stall(t, stall)
        if is_stop:
            self.stop_stall += added
        else:
            self.switch_stall += added
        self._after_hook(t)

    def _after_hook(self, t: float) -> None:
        """New rate; a deferred switch is due its delay after training resumes (the pending
        tuple's device slot carries the policy's generation)."""
        self.clock.rate = self.policy.rate()
        if self.policy.deferred_s is not None:
            ready_t = max(t, self.clock.resume) + self.policy.deferred_s
            heapq.heappush(self.pending, (ready_t, READY, self.policy.generation, -1))
            self.policy.deferred_s = None
        for at_s, key, serial in self.policy.wakeups:
            heapq.heappush(self.pending, (at_s, WAKE, key, serial))
        self.policy.wakeups.clear()

    def _handle(self, t: float, kind: int, index: int) -> tuple[float, bool]:
        tr, live, policy = self.trace, self.live, self.policy
        if kind == STOP:
            dev = int(tr.stop_dev_F[index])
            if dev in live.dead:
                return 0.0, False
            live.dead.add(dev)
            live.slow.pop(dev, None)
            self.active.pop(dev, None)
            self.n_stops += 1
            return policy.on_stop(dev, float(tr.replace_t_F[index]), t), True
        if kind == REPLACE:
            dev = int(tr.stop_dev_F[index])
            if dev not in live.dead:
                return 0.0, False
            live.dead.discard(dev)
            return policy.on_replace(dev), False
        return self._slow_event(t, kind, index), False

    def _slow_event(self, t: float, kind: int, index: int) -> float:
        tr, live, policy = self.trace, self.live, self.policy
        dev = int(tr.slow_dev_E[index])
        if kind == SLOW_START:
            if dev in live.dead or dev in live.slow:
                return 0.0
            live.slow[dev] = (float(tr.slow_factor_E[index]), int(tr.slow_kind_E[index]))
            self.active[dev] = index
            delay = policy.detect_delay_s(dev, self.rng)
            if math.isfinite(delay):
                heapq.heappush(self.pending, (t + delay, DETECT, dev, index))
            return 0.0
        if self.active.get(dev) != index:
            return 0.0
        live.slow.pop(dev)
        self.active.pop(dev)
        if dev in policy.known:
            heapq.heappush(self.pending, (t + policy.clear_delay_s(), CLEAR, dev, index))
        return 0.0

    def internal(self, t: float, kind: int, dev: int, episode: int) -> None:
        policy = self.policy
        if kind == DETECT and self.active.get(dev) == episode and dev not in policy.known:
            hook = functools.partial(policy.on_detect, dev)
        elif kind == CLEAR and dev in policy.known and dev not in self.live.slow:
            hook = functools.partial(policy.on_clear, dev)
        elif kind == READY and dev == policy.generation:
            hook = policy.on_ready
        elif kind == WAKE:
            hook = functools.partial(policy.on_wake, dev, episode)
        else:
            return
        self.clock.advance(t)
        self.switch_stall += self.clock.stall(t, hook())
        self._after_hook(t)

    def run(self) -> None:
        self.clock.rate = self.policy.rate()
        for t, kind, index in _trace_events(self.trace):
            self._drain(t)
            self.clock.advance(t)
            self.apply(t, kind, index)
        self._drain(self.trace.duration_s)
        self.clock.advance(self.trace.duration_s)

    def _drain(self, until: float) -> None:
        while self.pending and self.pending[0][0] <= until:
            t, kind, dev, episode = heapq.heappop(self.pending)
            self.internal(t, kind, dev, episode)


def simulate(name: str, cm: ClusterModel, trace: Trace, stop_rate_per_s: float, seed: int,
             record: bool = False) -> RunResult:
    """Run policy `name` through `trace` on cluster `cm`."""
    if trace.n_gpus != cm.n_gpus:
        raise ConfigError(f"trace is for {trace.n_gpus} GPUs, the cluster has {cm.n_gpus}")
    if name not in POLICIES:
        raise ConfigError(f"unknown policy {name!r}; valid: {', '.join(POLICIES)}")
    policy = POLICIES[name](cm, Live())
    policy.mtbf_s = 1.0 / stop_rate_per_s if stop_rate_per_s > 0 else math.inf
    run = _Run(policy, trace, seed)
    run.run()
    clock, duration = run.clock, trace.duration_s
    fig = policy.figures
    steps = clock.running / cm.ref_step_s
    alarms = 0.0 if fig is None else fig.false_alarms_per_step * steps
    segments = np.asarray(clock.segments if record else [], dtype=np.float64).reshape(-1, 3)
    return RunResult(
        name, clock.tokens / duration, clock.tokens / clock.running if clock.running else 0.0,
        run.stop_stall / run.n_stops if run.n_stops else math.nan, run.n_stops, alarms,
        alarms * policy.probe_s(), run.switch_stall, segments)
