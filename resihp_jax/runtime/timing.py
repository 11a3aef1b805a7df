"""Per-step host time and per-stage busy times from the Instrument's host callbacks.

`StageTimer` is an Instrument host function: it reads the clock at the start and end of the
one region the train step times on each device, the forward of the group's micro-batch slot
`TIMED_SLOT` through the stage's layers (tick = stage + TIMED_SLOT), and ignores every other
event (a slowed device's markers fire on all its ticks, for the fault injector). Each
device's callbacks arrive in order from one thread and every device writes only its own
slot, so no lock is needed; the cost is two callbacks and two clock reads per device and step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

from resihp_jax.meshes.plan import TIMED_SLOT
from resihp_jax.train.instrument import FWD_END, FWD_START


@dataclass(frozen=True)
class StepTiming:
    step_time_s: float  # host wall time of the whole step (dispatch to results ready)
    fwd_DxPxT: np.ndarray  # each device's timed forward (0: not timed)

    @property
    def stage_DxP(self) -> np.ndarray | None:
        """Timed forward of each (dp, pp) stage (slowest tp member); None if not timed."""
        stage = self.fwd_DxPxT.max(axis=2)
        return stage if np.all(stage > 0) else None


class StageTimer:
    """Each device's timed forward between `begin()` and `end()`."""

    def __init__(self, shape_DxPxT: tuple[int, int, int],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.shape = tuple(shape_DxPxT)
        self._clock = clock
        self._start = np.zeros(self.shape)
        self._fwd = np.zeros(self.shape)
        self._open = np.zeros(self.shape, dtype=bool)  # inside a busy region now
        self._t0 = 0.0

    def __call__(self, event: int, dp: int, pp: int, tp: int, knob: float, busy: bool,
                 tick: int) -> None:
        if not busy or tick - pp != TIMED_SLOT:
            return
        key = (dp, pp, tp)
        if event == FWD_START:
            self._start[key] = self._clock()
            self._open[key] = True
        elif event == FWD_END:
            self._fwd[key] = self._clock() - self._start[key]
            self._open[key] = False

    def begin(self) -> None:
        self._fwd[:] = 0.0
        self._open[:] = False
        self._t0 = self._clock()

    def end(self) -> StepTiming:
        return StepTiming(self._clock() - self._t0, self._fwd.copy())

    def in_flight(self) -> list[tuple[int, int, int]]:
        """Coordinates that started their timed work and never finished it (a hung device)."""
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
        return state, metrics, StepTiming(step_s, np.zeros(shape))
    return state, metrics, StepTiming(step_s, timer.end().fwd_DxPxT)
