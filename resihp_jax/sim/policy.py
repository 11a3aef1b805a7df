"""What every simulated system is: live cluster health, and a policy reacting to its events.

A policy returns, for each event, the seconds training stalls, and its throughput as a share
of the best healthy plan's. `Live` is the cluster's true health; a policy sees fail-stops at
once and fail-slows only once its detector has caught them (`known`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from resihp_jax.sim.cluster import ClusterModel
from resihp_jax.sim.measured import DETECTORS, DetectorFigures
from resihp_jax.sim.traces import COMPUTE

# A probe (detector validation) runs one micro-batch's forward and backward on every stage,
# `PROBE_RUNS` times (2 runs, and a third when ambiguous: `resihp_jax/detector/base.py`).
PROBE_RUNS = 3
# Periodic checkpoints of systems that restore from peers: once an hour, 10 s of blocking
# copy to host memory each (async write after); synchronous restart systems checkpoint on
# Young's interval sqrt(2 * cost * MTBF) instead (see `young_interval_s`).
CHECKPOINT_BLOCK_S = 10.0
PEER_CHECKPOINT_INTERVAL_S = 3600.0


@dataclass
class Live:
    """True health: GPUs down (not yet replaced) and slow GPUs (factor, kind)."""

    dead: set[int] = field(default_factory=set)
    slow: dict[int, tuple[float, int]] = field(default_factory=dict)


class SimPolicy:
    """Base: no fail-slow detection; subclasses override the event hooks and `rate`."""

    name = "base"
    detector: str | None = None
    mtbf_s = math.inf  # the job's mean time between fail-stops, as its operator knows it

    def __init__(self, cm: ClusterModel, live: Live) -> None:
        self.cm, self.live = cm, live
        self.known: dict[int, tuple[float, int]] = {}
        pp, tp = cm.base
        self.replica_size = pp * tp
        # a switch finishing later (a program compiling in the background): the engine takes
        # `deferred_s` after each hook and calls `on_ready` then, unless `generation` moved on
        self.deferred_s: float | None = None
        self.generation = 0
        # timers of their own (a replica's rejoin): (time, key, serial) the engine calls
        # `on_wake(key, serial)` at; the policy ignores a serial it has moved past
        self.wakeups: list[tuple[float, int, int]] = []

    # ---- hooks (return stall seconds) ------------------------------------------------
    def on_stop(self, device: int, replace_at_s: float, now_s: float) -> float:
        self.known.pop(device, None)
        return sum(self.stop_terms().values())

    def stop_terms(self) -> dict[str, float]:
        """What one fail-stop stalls, term by term, its replacement already there (`on_stop`
        charges their sum, plus any wait for a replacement)."""
        raise NotImplementedError

    def on_replace(self, device: int) -> float:
        return 0.0

    def on_detect(self, device: int) -> float:
        self.known[device] = self.live.slow[device]
        return self.on_known_change()

    def on_clear(self, device: int) -> float:
        self.known.pop(device, None)
        return self.on_known_change()

    def on_known_change(self) -> float:
        """React to a slow GPU detected or cleared (`self.known` is up to date)."""
        return 0.0

    def on_ready(self) -> float:
        """A deferred switch's program is ready: switch (returns the stall)."""
        return 0.0

    def on_wake(self, key: int, serial: int) -> float:
        """A timer of `wakeups` is due (returns the stall)."""
        return 0.0

    def rate(self) -> float:
        raise NotImplementedError

    # ---- shared helpers ----------------------------------------------------------------
    @property
    def figures(self) -> DetectorFigures | None:
        return None if self.detector is None else DETECTORS[self.detector]

    def interval_s(self) -> float:
        """Seconds between periodic checkpoints."""
        return PEER_CHECKPOINT_INTERVAL_S

    def overhead_factor(self) -> float:
        """Throughput kept after false-alarm probes and periodic checkpoints."""
        keep = 1.0 - CHECKPOINT_BLOCK_S / self.interval_s()
        fig = self.figures
        if fig is not None:
            keep /= 1.0 + fig.false_alarms_per_step * self.probe_s() / self.cm.ref_step_s
        return keep

    def _of_ref(self, step_s: float) -> float:
        """A step of `step_s` as a share of the reference plan's healthy throughput."""
        return self.cm.tokens_per_step / step_s / self.cm.ref_tokens_per_s

    def probe_s(self) -> float:
        return PROBE_RUNS * self.cm.cost(*self.cm.base).tick_s

    def slowdown(self, device: int, info: tuple[float, int]) -> float:
        """How many times slower this GPU makes its group's step."""
        factor, kind = info
        return factor if kind == COMPUTE else 1.0 + self.cm.link_share * (factor - 1.0)

    def unknown_gate(self, unusable: set[int] | frozenset[int]) -> float:
        """The slowest undetected slow GPU still in use gates every step."""
        gates = [self.slowdown(d, i) for d, i in self.live.slow.items()
                 if d not in self.known and d not in unusable]
        return max(gates, default=1.0)

    def detect_delay_s(self, device: int, rng: np.random.Generator) -> float:
        """Seconds until this policy's detector names the slow GPU (inf: never)."""
        fig = self.figures
        if fig is None:
            return math.inf
        seen = self.slowdown(device, self.live.slow[device])
        if seen < fig.partial or (seen < fig.reliable and rng.random() >= fig.rate_between):
            return math.inf
        return fig.delay_steps(seen) * self.cm.ref_step_s * seen

    def clear_delay_s(self) -> float:
        fig = self.figures
        return 0.0 if fig is None else fig.delay_large * self.cm.ref_step_s

    def replica_of(self, device: int) -> int:
        return device // self.replica_size

    def stage_of(self, device: int) -> int:
        return (device % self.replica_size) // self.cm.base[1]


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval."""
    return math.sqrt(2.0 * cost_s * mtbf_s)
