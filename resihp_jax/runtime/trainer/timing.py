"""Per-step host time and per-stage busy times from the Instrument's host callbacks.

`StageTimer` is an Instrument host function timing the one region the train step times on
each device, the forward of micro-batch slot `TIMED_SLOT` through the stage's layers (tick =
stage + TIMED_SLOT); it ignores every other event (a slowed device's markers fire on all its
ticks, for the fault injector). Each device's callbacks arrive in order from one thread and
each device writes only its own slot, so no lock is needed: two callbacks and two clock
reads per device and step (with a `CpuMeter`, two reads of /proc/stat per step).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np

from resihp_jax.detector.verdict import HostCpu
from resihp_jax.plan import TIMED_SLOT
from resihp_jax.runtime.trainer.host_cpu import CpuMeter
from resihp_jax.step.instrument import FWD_END, FWD_START, RegionTimer


@dataclass(frozen=True)
class StepTiming:
    step_time_s: float  # host wall time of the whole step (dispatch to results ready)
    fwd_DxPxT: np.ndarray  # each device's timed forward (0: not timed)
    host_cpu: HostCpu | None = None  # this process's and its host's CPU use meanwhile

    def gathered_with(self, values: Sequence[float]) -> tuple[StepTiming, np.ndarray]:
        """This step as the whole job saw it, and each of `values`' maximum over the
        processes, in one all-gather (a step's other agreement rides along). The step took as
        long as its slowest process waited for it; the host CPU is each field's maximum over
        the processes that measured it (a load on any one host slows the whole step)."""
        from resihp_jax.meshes.agree import max_over_processes  # noqa: PLC0415

        cpu = self.host_cpu
        unmeasured = (0.0, -np.inf, 1)  # never the maximum of a process that measured
        head = [self.step_time_s, cpu is not None,
                *((cpu.own, cpu.others, cpu.cores) if cpu is not None else unmeasured)]
        n = len(values)
        flat = max_over_processes(np.concatenate([head, np.asarray(values, np.float64),
                                                  self.fwd_DxPxT.ravel()]))
        gathered = HostCpu(float(flat[2]), float(flat[3]), int(flat[4]),
                           every_device=jax.process_count() == 1) if flat[1] else None
        return (StepTiming(float(flat[0]), flat[5 + n:].reshape(self.fwd_DxPxT.shape), gathered),
                flat[5:5 + n])

    @property
    def stage_DxP(self) -> np.ndarray | None:
        """Timed forward of each (dp, pp) stage (slowest tp member); None if not timed."""
        stage = self.fwd_DxPxT.max(axis=2)
        return stage if np.all(stage > 0) else None


class StageTimer:
    """Each device's timed forward between `begin()` and `end()`."""

    def __init__(self, shape_DxPxT: tuple[int, int, int],
                 clock: Callable[[], float] = time.perf_counter,
                 cpu: CpuMeter | None = None) -> None:
        self.shape = tuple(shape_DxPxT)
        self.cpu = cpu
        self._regions = RegionTimer(clock)
        self._fwd = np.zeros(self.shape)
        self._t0 = 0.0
        # host seconds spent timing (the callbacks' own work, the CPU counters' reads): the
        # "timing" part of a run's resilience overhead. Callbacks of several devices add to
        # it from their own threads; a lost update under-counts by one callback at most
        self.spent_s = 0.0

    def __call__(self, event: int, dp: int, pp: int, tp: int, knob: float, busy: bool,
                 tick: int) -> None:
        if not busy or tick - pp != TIMED_SLOT:
            return
        entered = time.perf_counter()
        key = (dp, pp, tp)
        if event == FWD_START:
            self._regions.start(key)
        elif event == FWD_END:
            elapsed = self._regions.stop(key)
            if elapsed is not None:
                self._fwd[key] = elapsed
        self.spent_s += time.perf_counter() - entered

    def begin(self) -> None:
        self._fwd[:] = 0.0
        self._regions.clear()
        if self.cpu is not None:
            entered = time.perf_counter()
            self.cpu.begin()
            self.spent_s += time.perf_counter() - entered
        self._t0 = self._regions.clock()

    def end(self) -> StepTiming:
        elapsed = self._regions.clock() - self._t0
        cpu = None
        if self.cpu is not None:
            entered = time.perf_counter()
            cpu = self.cpu.end()
            self.spent_s += time.perf_counter() - entered
        return StepTiming(elapsed, self._fwd.copy(), cpu)

    def in_flight(self) -> list[tuple[int, int, int]]:
        """Coordinates that started their timed work and never finished it (a hung device)."""
        return sorted(self._regions.open_keys())  # type: ignore[arg-type]


def timed_step(program: Any, state: Any, batch: Any, knobs_DxPxT: np.ndarray | None,
               timer: StageTimer | None = None,
               dispatched: threading.Event | None = None,
               run: Callable[..., tuple[Any, dict[str, Any]]] | None = None
               ) -> tuple[Any, dict[str, Any], StepTiming]:
    """Run one step to completion and time it with `timer` (per-stage times too when it is
    the program's Instrument host; None: the step alone). `dispatched` is set once the step
    is on its way to the devices. `run(program, state, batch, knobs)` runs the step (default:
    the program's own; a cross-replica collaborator's, runtime/replicas/protocol.py)."""
    if timer is None:
        timer = StageTimer((program.plan.dp, program.plan.pp, program.plan.tp))
    timer.begin()
    if run is None:
        state, metrics = program.step(state, batch, knobs_DxPxT)
    else:
        state, metrics = run(program, state, batch, knobs_DxPxT)
    if dispatched is not None:
        dispatched.set()
    # the step's time is read when its loss is ready, which the loop fetches anyway
    jax.block_until_ready(metrics)
    timing = timer.end()
    # and the step counts as done once all of its state is (its last buffers, the
    # optimizer's update, can end after the loss): the survivors' copy of a step must be
    # whole, and a hang there is still this step's, under its deadline
    return jax.block_until_ready(state), metrics, timing
