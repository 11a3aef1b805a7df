"""A `jax.profiler` trace of chosen steps (`profile_steps=(10, 13)`: 10 to 12) or, on
`kill -USR2 PID`, of the next SIGNAL_STEPS, into the metrics directory (TensorBoard's profile
tab). The handler only sets a flag that the loop reads between steps.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable

from resihp_jax.errors import ConfigError

SIGNAL_STEPS = 3


def check_steps(steps: Any, name: str = "profile_steps") -> tuple[int, int] | None:
    """(first, end) with 1 <= first < end, or None; ConfigError otherwise."""
    if steps is None:
        return None
    try:
        first, end = (int(s) for s in steps)
        ok = all(not isinstance(s, bool) and int(s) == s for s in steps)
    except (TypeError, ValueError):
        ok = False
    if not ok or not 1 <= first < end:
        raise ConfigError(f"{name}={steps!r}: expected (first, end) steps with 1 <= first < "
                          "end, e.g. (10, 13) for steps 10, 11 and 12")
    return first, end


class Profiler:
    """Starts and stops the trace between steps: `between_steps(done)` after step `done`
    (and once before the first step, with the step the run starts from)."""

    def __init__(self, directory: str, steps: tuple[int, int] | None = None,
                 say: Callable[[str], None] | None = None, on_signal: bool = True) -> None:
        self.directory, self.steps, self.say = directory, steps, say
        self.traced: list[tuple[int, int]] = []  # (first, last) step of each trace written
        self._stop_after: int | None = None
        self._first = 0
        self._asked = False
        self._previous: Any = None
        self._installed = False
        if on_signal and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGUSR2, self._on_signal)
            self._installed = True

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._asked = True  # the loop starts the trace between steps

    def between_steps(self, done: int) -> None:
        if self._stop_after is not None and done >= self._stop_after:
            self._stop(done)
        if self._stop_after is not None:
            return
        if self.steps is not None and self.steps[0] <= done + 1 < self.steps[1]:
            self._start(done + 1, self.steps[1] - 1)
        elif self._asked:
            self._asked = False
            self._start(done + 1, done + SIGNAL_STEPS)

    def _start(self, first: int, last: int) -> None:
        import jax  # noqa: PLC0415

        jax.profiler.start_trace(self.directory)
        self._first, self._stop_after = first, last

    def _stop(self, done: int) -> None:
        import jax  # noqa: PLC0415

        jax.profiler.stop_trace()
        self.traced.append((self._first, done))
        self._stop_after = None
        if self.steps is not None and done >= self.steps[1] - 1:
            self.steps = None  # traced once
        if self.say is not None:
            self.say(f"profile: steps {self._first}-{done} traced into {self.directory} "
                     "(TensorBoard's profile tab)")

    def close(self, done: int | None = None) -> None:
        """Stop a trace under way (the run ended inside it) and the signal handler."""
        if self._stop_after is not None:
            self._stop(done if done is not None else self._stop_after)
        if self._installed:
            self._installed = False
            signal.signal(signal.SIGUSR2, signal.SIG_DFL if self._previous is None
                          else self._previous)
