"""Per-step host time and per-stage busy times from the Instrument's host callbacks.

`StageTimer` is an Instrument host function: on each busy start/end event it reads the clock
and adds the interval to that device's forward or backward busy time. Each device's callbacks
arrive in order from one thread and every device writes only its own slot, so no lock is
needed and the cost is two clock reads and a few array stores per tick.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

from resihp_jax.train.instrument import BWD_END, BWD_START, FWD_END, FWD_START


@dataclass(frozen=True)
class StepTiming:
    step_time_s: float  # host wall time of the whole step (dispatch to results ready)
    fwd_DxPxT: np.ndarray  # busy forward seconds of each device
    bwd_DxPxT: np.ndarray  # busy backward seconds of each device

    @property
    def stage_DxP(self) -> np.ndarray:
        """Busy time of each (dp, pp) stage: forward + backward, slowest tp member."""
        return (self.fwd_DxPxT + self.bwd_DxPxT).max(axis=2)


class StageTimer:
    """Accumulates per-device busy times between `begin()` and `end()`."""

    def __init__(self, shape_DxPxT: tuple[int, int, int],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.shape = tuple(shape_DxPxT)
        self._clock = clock
        self._start = np.zeros(self.shape)
        self._fwd = np.zeros(self.shape)
        self._bwd = np.zeros(self.shape)
        self._open = np.zeros(self.shape, dtype=bool)  # inside a busy region now
        self._t0 = 0.0

    def __call__(self, event: int, dp: int, pp: int, tp: int, knob: float, busy: bool,
                 tick: int) -> None:
        if not busy:
            return
        key = (dp, pp, tp)
        now = self._clock()
        if event == FWD_START or event == BWD_START:
            self._start[key] = now
            self._open[key] = True
        elif event == FWD_END:
            self._fwd[key] += now - self._start[key]
            self._open[key] = False
        elif event == BWD_END:
            self._bwd[key] += now - self._start[key]
            self._open[key] = False

    def begin(self) -> None:
        self._fwd[:] = 0.0
        self._bwd[:] = 0.0
        self._open[:] = False
        self._t0 = self._clock()

    def end(self) -> StepTiming:
        return StepTiming(self._clock() - self._t0, self._fwd.copy(), self._bwd.copy())

    def in_flight(self) -> list[tuple[int, int, int]]:
        """Coordinates that started stage work and never finished it (a hung device)."""
        return [tuple(int(c) for c in idx) for idx in zip(*np.nonzero(self._open))]


def timed_step(program: Any, state: Any, batch: Any, knobs_DxPxT: np.ndarray | None,
               timer: StageTimer | None = None) -> tuple[Any, dict[str, Any], StepTiming]:
    """Run one step to completion and time it (per-stage times when `timer` is the program's
    Instrument host, or part of it)."""
    if timer is not None:
        timer.begin()
    t0 = time.perf_counter()
    state, metrics = program.step(state, batch, knobs_DxPxT)
    jax.block_until_ready(metrics)
    step_s = time.perf_counter() - t0
    if timer is None:
        shape = (program.plan.dp, program.plan.pp, program.plan.tp)
        return state, metrics, StepTiming(step_s, np.zeros(shape), np.zeros(shape))
    timing = timer.end()
    return state, metrics, StepTiming(step_s, timing.fwd_DxPxT, timing.bwd_DxPxT)
