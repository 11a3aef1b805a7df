"""A slow disk under a Checkpointer: each background write lasts at least a given time.

After `slow_writes(ckpt, seconds)` every asynchronous write `ckpt` starts counts as under way
for at least `seconds` after its save returned, and waiting for it (orbax does before a next
save, as does `Checkpointer.wait`) lasts until then; the real write still happens
underneath, so what is saved is restorable. Clock and sleep are injected for tests.
"""

from __future__ import annotations

import time
from typing import Any, Callable


def slow_writes(ckpt: Any, seconds: float | Callable[[], float], *,
                clock: Callable[[], float] = time.monotonic,
                sleep: Callable[[float], None] = time.sleep) -> None:
    """Slow every later write of `ckpt` (a Checkpointer) to at least `seconds` (or what the
    function returns, asked at each save, e.g. 10x the step's time)."""
    manager = ckpt._manager  # noqa: SLF001 - the fault acts where orbax waits
    real_save, real_wait = manager.save, manager.wait_until_finished
    real_in_progress = manager.is_saving_in_progress
    busy_until = [float("-inf")]

    def save(*args: Any, **kwargs: Any) -> bool:
        saved = real_save(*args, **kwargs)  # (waits for the previous write: see wait)
        if saved:
            busy_until[0] = clock() + (seconds() if callable(seconds) else seconds)
        return saved

    def wait_until_finished() -> None:
        left = busy_until[0] - clock()
        if left > 0:
            sleep(left)
        real_wait()

    def is_saving_in_progress() -> bool:
        if clock() < busy_until[0]:
            return True
        if busy_until[0] > float("-inf"):
            real_wait()  # the slow disk's time covers the real write underneath
        return bool(real_in_progress())

    # orbax's own save calls self.wait_until_finished(): the instance's, so these
    manager.save, manager.wait_until_finished = save, wait_until_finished
    manager.is_saving_in_progress = is_saving_in_progress
