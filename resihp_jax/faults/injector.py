"""Fault injection on fake devices: slow a chosen device by a factor from a chosen step (and
optionally let it recover), or stop it.

`FaultInjector` is an Instrument host function: it times each device's busy stage work and,
when the device's knob is a slowdown factor f > 1, sleeps (f - 1) * elapsed at the end event,
so everything the Instrument brackets on that device takes f times as long. `knobs(step)`
raises `DeviceStoppedError` when a device of the plan is dead at that step.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan
from resihp_jax.step.instrument import BWD_END, BWD_START, FWD_END, FWD_START, RegionTimer

_STARTS = (FWD_START, BWD_START)
_ENDS = (FWD_END, BWD_END)


class DeviceStoppedError(RuntimeError):
    """A device the step needs has stopped; `device_ids` names it (them)."""

    def __init__(self, device_ids: tuple[int, ...], step: int) -> None:
        self.device_ids = tuple(sorted(device_ids))
        self.step = step
        super().__init__(f"device(s) {list(self.device_ids)} stopped: step {step} cannot run "
                         "(fail-stop)")


@dataclass(frozen=True)
class SlowFault:
    device_id: int
    factor: float
    start_step: int
    end_step: int | None = None  # first healthy step again; None = never recovers

    def active(self, step: int) -> bool:
        return step >= self.start_step and (self.end_step is None or step < self.end_step)


class FaultInjector:
    """Host function + knob source. Thread-safe: XLA calls it from many threads at once."""

    def __init__(self, plan: Plan, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.plan = plan
        self._sleep, self._clock = sleep, clock
        self._slow: list[SlowFault] = []
        self._dead: dict[int, int] = {}  # device id -> first step it is dead
        self._regions = RegionTimer(clock)
        self._lock = threading.Lock()
        self.injected_s = 0.0  # total sleep added, for reporting

    # ---- configuring faults ----------------------------------------------------------------
    def slow(self, device_id: int, factor: float, start_step: int = 0,
             end_step: int | None = None) -> SlowFault:
        self._check_device(device_id)
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 1.0):
            raise ConfigError(f"slowdown factor={factor!r}: must be a finite number >= 1")
        if end_step is not None and end_step <= start_step:
            raise ConfigError(f"end_step={end_step} must be > start_step={start_step}")
        fault = SlowFault(int(device_id), float(factor), int(start_step), end_step)
        self._slow.append(fault)
        return fault

    def kill(self, device_id: int, at_step: int = 0) -> None:
        self._check_device(device_id)
        self._dead[int(device_id)] = int(at_step)

    def clear(self) -> None:
        self._slow.clear()
        self._dead.clear()

    def with_plan(self, plan: Plan) -> FaultInjector:
        """Same faults (by device id) seen through another plan's mesh coordinates."""
        out = FaultInjector(plan, self._sleep, self._clock)
        out._slow, out._dead = list(self._slow), dict(self._dead)
        return out

    # ---- what a step sees -----------------------------------------------------------------
    def dead(self, step: int) -> tuple[int, ...]:
        return tuple(sorted(d for d, s in self._dead.items() if step >= s))

    def factor(self, device_id: int, step: int) -> float:
        """Compute slowdown of a device at a step (product of the active faults on it)."""
        return math.prod((f.factor for f in self._slow
                          if f.device_id == device_id and f.active(step)), start=1.0)

    def knobs(self, step: int) -> np.ndarray:
        """[dp, pp, tp] float32 slowdown factors for `program.step`; raises if one is dead."""
        dead = [d for d in self.dead(step) if d in self.plan.device_ids]
        if dead:
            raise DeviceStoppedError(tuple(dead), step)
        factor = np.vectorize(lambda d: self.factor(int(d), step), otypes=[np.float32])
        return factor(self.plan.device_grid())

    # ---- the Instrument host function -----------------------------------------------------
    def __call__(self, event: int, dp: int, pp: int, tp: int, knob: float, busy: bool,
                 tick: int) -> None:
        if not busy or knob <= 1.0:
            return
        key = (dp, pp, tp)
        if event in _STARTS:
            self._regions.start(key)
        elif event in _ENDS:
            elapsed = self._regions.stop(key)
            if elapsed is None:
                return
            delay = (knob - 1.0) * elapsed
            self._sleep(delay)
            with self._lock:
                self.injected_s += delay

    def _check_device(self, device_id: int) -> None:
        if device_id not in self.plan.device_ids:
            raise ConfigError(f"device {device_id!r} is not in the plan's devices "
                              f"{sorted(self.plan.device_ids)}")
