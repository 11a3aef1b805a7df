"""The interpreter's lock handed back to the step loop at once while other threads work.

A training process runs Python besides its step loop: the background compiles of the likely
next plans and the layout moves (precompile.py: tracing and lowering are pure Python), orbax's
write threads, the survivors' copy writers, the step guard. Each time the loop waits on the
devices it lets go of the GIL, and each time it wants it back it waits until the thread that
took it is made to let go: by default after 5 ms (`sys.getswitchinterval`). A loop that waits
ten times a step then loses up to 50 ms a step while a background thread traces: on a GPU,
where the step itself is 40 ms, that halves the throughput for as long as the compiles last
(what an all-Python background thread did to a 2,000-GPU job; benchmarks/gil_contention.py
shows it here, 21 ms steps taking 60-64). With a 0.1 ms interval the loop gets the lock back
within 0.1 ms; the price, a thread switch every 0.1 ms between threads that both want to run,
falls on the background work, whose seconds are off the step's path.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

SWITCH_INTERVAL_S = 1e-4  # the interpreter's default is 5e-3


@contextlib.contextmanager
def responsive_loop(interval_s: float = SWITCH_INTERVAL_S) -> Iterator[None]:
    """While open, a thread that wants the GIL gets it within `interval_s` (never longer
    than it already would); the previous interval comes back on exit."""
    before = sys.getswitchinterval()
    if before <= interval_s:  # already as short (a nested loop): left alone, not re-rounded
        yield
        return
    sys.setswitchinterval(interval_s)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
