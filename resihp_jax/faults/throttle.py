"""Make a running process really slower: a CPU quota enforced from outside.

Every `period_s` the process (its whole process group) runs for period/factor, then is
stopped (SIGSTOP) for the rest and continued (SIGCONT): what a cgroup CPU quota does, with
no cooperation from the process and no sleep in our own code. Used by `resihp launch
--slow` to reproduce a fail-slow host.
"""

from __future__ import annotations

import os
import signal
import threading


class Throttle:
    def __init__(self, pid: int, factor: float, period_s: float = 0.02) -> None:
        if not factor > 1:
            raise ValueError(f"throttle factor={factor!r}: must be > 1")
        self.pid, self.factor, self.period_s = pid, factor, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="resihp-throttle")
        self._thread.start()

    def _signal(self, sig: int) -> bool:
        try:
            os.killpg(self.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def _run(self) -> None:
        run_s = self.period_s / self.factor
        while not self._stop.is_set():
            if self._stop.wait(run_s) or not self._signal(signal.SIGSTOP):
                break
            self._stop.wait(self.period_s - run_s)
            if not self._signal(signal.SIGCONT):
                break
        self._signal(signal.SIGCONT)

    def stop(self) -> None:
        """Lift the quota (the process runs freely again)."""
        self._stop.set()
        self._thread.join()
