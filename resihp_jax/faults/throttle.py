"""Make a running process really slower, from outside: a slow device, reproduced on a host.

A device FACTOR times slower takes FACTOR times as long for its own work, and no longer to
wait for its peers. On shared host cores a process's "device time" is the time it wants a
core (running, or runnable and waiting), which the kernel counts per thread
(/proc/PID/task/*/schedstat). So after each `period_s` of such busy time the throttle stops
the process's group (SIGSTOP) for FACTOR - 1 times as long, then continues it. Blocked time
(a collective waiting for a slower peer) is never stretched, and on a loaded host the stretch
follows the time its work really takes; a CPU quota of 1/FACTOR does neither (on 2 cores
shared by 4 processes, x4 cost the job only 1.35x: `benchmarks/multiprocess.py`). Where the
counters cannot be read, the throttle falls back to a wall-clock duty cycle and says so in
`mode`. Used by `resihp launch --slow`; the counters and the clock are injected for tests.
"""

from __future__ import annotations

import glob
import os
import signal
import threading
import time
from typing import Callable

BUSY = "busy"  # stretch the process's own busy time (schedstat)
DUTY = "duty"  # wall-clock duty cycle (no schedstat here)


def busy_s(pid: int) -> float | None:
    """Seconds the threads of `pid` have run or waited for a core, summed (None: unknown)."""
    total, found = 0, False
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(path, encoding="ascii") as f:
                run_ns, wait_ns = f.read().split()[:2]
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        total, found = total + int(run_ns) + int(wait_ns), True
    return total / 1e9 if found else None


class Throttle:
    def __init__(self, pid: int, factor: float, period_s: float = 0.01,
                 busy: Callable[[int], float | None] = busy_s,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not factor > 1:
            raise ValueError(f"throttle factor={factor!r}: must be > 1")
        self.pid, self.factor, self.period_s = pid, factor, period_s
        self._busy, self._clock = busy, clock
        self.mode = BUSY if busy(pid) is not None else DUTY
        self.busy_s = 0.0  # the process's busy time since the throttle began
        self.stopped_s = 0.0  # how long it was held stopped
        self.holds: list[tuple[float, float]] = []  # each stop: (busy time it paid for, held)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="resihp-throttle")
        self._thread.start()

    def _signal(self, sig: int) -> bool:
        try:
            os.killpg(self.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def _hold(self, busy: float) -> bool:
        """Stop the process for FACTOR - 1 times `busy` (False: it is gone, or the throttle
        is lifted)."""
        if not self._signal(signal.SIGSTOP):
            return False
        t0 = self._clock()
        lifted = self._stop.wait((self.factor - 1.0) * busy)
        held = self._clock() - t0
        self.stopped_s += held
        self.holds.append((busy, held))
        return self._signal(signal.SIGCONT) and not lifted

    def _run(self) -> None:
        try:
            if self.mode == BUSY:
                self._run_busy()
            else:
                self._run_duty()
        finally:
            self._signal(signal.SIGCONT)

    def _run_busy(self) -> None:
        owed, last, t_last = 0.0, self._busy(self.pid), self._clock()
        while not self._stop.wait(self.period_s):
            now, t = self._busy(self.pid), self._clock()
            if now is None or last is None:
                return  # the process is gone
            wall = t - t_last
            # several threads busy at once are one busy stretch of the process
            stretch = min(max(now - last, 0.0), wall)
            self.busy_s += stretch
            owed += stretch
            if owed >= self.period_s:
                if not self._hold(owed):
                    return
                owed = 0.0
            # a stopped process accrues no busy time: measure afresh from here
            last, t_last = self._busy(self.pid), self._clock()

    def _run_duty(self) -> None:
        run_s = self.period_s / self.factor
        while not self._stop.wait(run_s):
            self.busy_s += run_s
            if not self._hold(run_s):  # stopped for period - run_s
                return

    def stop(self) -> None:
        """Lift the slowdown (the process runs freely again)."""
        self._stop.set()
        self._thread.join()
