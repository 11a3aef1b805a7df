"""A process's own guard against a step that never ends.

In a multi-controller job a step blocked in a collective (a peer died or froze) can wait
far longer than the step could ever take. The watchdog ends this process once the step in
flight passes its deadline, with exit code `HUNG_EXIT`, so whatever runs the job (our
supervisor, SLURM's requeue, a Kubernetes restart policy) starts the next incarnation. The
clock and the way out are injected so tests need neither waiting nor a dying process.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

HUNG_EXIT = 75  # EX_TEMPFAIL: the job may be retried


def _exit_hung(message: str) -> None:
    # JAX is loaded by now
    from resihp_jax.runtime.recovery.host_snapshot import dump_active, prog  # noqa: PLC0415

    print(f"{prog()}: {message}; exiting with {HUNG_EXIT} so the job restarts",
          file=sys.stderr, flush=True)
    dump_active("step deadline passed")  # the relaunch rebuilds this step from the survivors
    os._exit(HUNG_EXIT)  # other threads may be blocked in a collective: no clean shutdown


class Watchdog:
    def __init__(self, on_expiry: Callable[[str], None] = _exit_hung,
                 clock: Callable[[], float] = time.monotonic, poll_s: float = 0.2) -> None:
        self.on_expiry, self.clock, self.poll_s = on_expiry, clock, poll_s
        self._armed: tuple[str, float, float] | None = None  # what, started, deadline_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="resihp-watchdog")
        self._thread.start()

    def arm(self, step: int, deadline_s: float, what: str = "") -> None:
        """Watch step `step` (or `what` after it, e.g. its checkpoint save)."""
        with self._lock:
            self._armed = (f"{what} of step {step}" if what else f"step {step}",
                           self.clock(), deadline_s)

    def disarm(self) -> None:
        with self._lock:
            self._armed = None

    def check(self) -> bool:
        """Fire if the armed step is past its deadline; whether it fired."""
        with self._lock:
            armed = self._armed
            if armed is None or self.clock() - armed[1] <= armed[2]:
                return False
            self._armed = None
        what, _, deadline = armed
        self.on_expiry(f"{what} did not finish within its deadline of {deadline:.1f} s "
                       "(a peer process died or froze, or a device hangs)")
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.check()

    def close(self) -> None:
        self._stop.set()
