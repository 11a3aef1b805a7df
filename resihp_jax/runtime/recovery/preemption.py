"""A one-process run's preemption: SIGTERM saves the step under way, then the run stops.

A one-process run keeps no survivors' copies (no survivor would serve them), so without
this a preemption would lose the training since its last checkpoint, up to the 'auto'
cadence's ceiling. SIGTERM only marks the checkpointer: the step under way finishes, its
`save` is forced and written to the end, and the checkpointer raises `Preempted`. The
handler runs in the main thread between bytecodes, also while it waits for a step's thread.
Here too, JAX-free and below both users (host_copies.py, job/exits.py): the codes a job's
SIGTERM ends a process with.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any, Mapping

from resihp_jax.env_vars import PEER_LOST_ENV

# SIGTERM: the scheduler preempts the job, or a failure ends it (srun, resihp launch). Its
# own code, so a job script tells a preemption from a failure
PREEMPTED_EXIT = 74
# A launcher that ends the job after another process failed (resihp launch) names the failure
# in the file PEER_LOST_ENV points to before its SIGTERM: the process then exits 75 (a peer
# was lost: restart, counted, not this process's fault; HUNG_EXIT in job/coordinator.py) with
# one line naming the lost peer, where a preemption's SIGTERM exits PREEMPTED_EXIT.
PEER_LOST_EXIT = 75


def peer_lost(environ: Mapping[str, str] | None = None) -> str | None:
    """The launcher's line naming the failure that ends the job (PEER_LOST_ENV), if any."""
    path = (os.environ if environ is None else environ).get(PEER_LOST_ENV)
    if not path:
        return None
    try:
        text = Path(path).read_text().strip()
    except OSError:  # no file: no failure named (a preemption, or the launcher's end)
        return None
    return text.splitlines()[0] if text else None


class SaveOnSigterm:
    """While open, SIGTERM makes `checkpointer`'s next save a forced one that ends the run."""

    def __init__(self, checkpointer: Any) -> None:
        self._old: Any = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, lambda *_: checkpointer.preempt())

    def close(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
            self._old = None
