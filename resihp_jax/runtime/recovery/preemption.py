"""A one-process run's preemption: SIGTERM saves the step under way, then the run stops.

A job of several processes answers SIGTERM with the survivors' copies (host_snapshot.py),
which a relaunch rebuilds the last step from. A one-process run keeps no such copies (it has
no survivor to serve them), so without this a preemption would lose the training since its
last checkpoint, up to the 'auto' cadence's ceiling. Here SIGTERM only marks the
checkpointer: the step under way finishes, its `save` is forced and written to the end, and
the checkpointer raises `Preempted` (the process then exits PREEMPTED_EXIT, 74). The handler
runs in the main thread between bytecodes, also while it waits for a step's thread.
"""

from __future__ import annotations

import signal
import threading
from typing import Any


class SaveOnSigterm:
    """While open, SIGTERM makes `checkpointer`'s next save a forced one that ends the run."""

    def __init__(self, checkpointer: Any) -> None:
        self._old: Any = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, lambda *_: checkpointer.preempt())

    @property
    def installed(self) -> bool:
        return self._old is not None

    def close(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
            self._old = None
