"""Process 0's coordination service, as the job's other processes see it.

Under SLURM and Kubernetes process 0 hosts JAX's coordination service. When process 0 dies,
JAX's coordination client in every other process aborts it (SIGABRT, exit 134): every
process seems to crash, every node is blamed, and the survivors never write their copies.
JAX 0.10 takes no callback that could make that error non-fatal (`missed_heartbeat_callback`
cannot be handed its status from Python: it aborts too), so a SIGABRT handler asks whether
the service still answers; where it does not, the process says in one line that process 0
is gone, writes its copy and exits HUNG_EXIT (75) like any process that lost a peer. Any
other abort goes on as it would have. A step that fails because process 0 died is named the
same way (`lost_line`, asked by exits.py); whichever path ends the process first is the only
one that speaks (`leaving`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
from typing import Any

from resihp_jax.runtime.recovery.preemption import PEER_LOST_EXIT

HUNG_EXIT = PEER_LOST_EXIT  # 75, EX_TEMPFAIL: the job may be retried (a process that lost a peer)


PROBE_TIMEOUT_S = 2.0  # a host that is gone does not refuse: it stays silent this long
# held by the path that is ending the process: a second path waits for the first to exit
_LEAVING = threading.Lock()
_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)
_installed: list[Any] = []  # the handler (kept alive: the C library holds only its address)
_hosted_by_process_0 = [True]  # False: `resihp launch` hosts the service (see distributed.py)


def answers(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether something accepts connections at HOST:PORT."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError):
        return False
    return True


def lost_line(address: str | None = None) -> str | None:
    """One line saying the job's coordination service is gone, naming who hosted it; None
    while it answers (or where this process is not one of a job's)."""
    address = address or _service_address()
    if address is None or answers(address):
        return None
    if _hosted_by_process_0[0]:
        return (f"process 0 is gone: the job's coordination service it hosted at {address} "
                "does not answer (process 0 died, or its host did)")
    return f"the job's coordination service at {address} (hosted by the launcher) is gone"


def leaving() -> None:
    """Take the right to end this process, waiting forever if another path holds it (that
    one is about to `os._exit`): one process, one final line."""
    _LEAVING.acquire()


def guard_coordinator_loss(hosted_by_process_0: bool = True) -> None:
    """In a process of a job: turn JAX's abort on the loss of the coordination service
    (hosted by process 0, else by the launcher) into HUNG_EXIT with one line."""
    _hosted_by_process_0[0] = hosted_by_process_0
    if _installed or not hasattr(signal, "SIGABRT"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    except (OSError, AttributeError):
        return  # no C library to ask: JAX's own abort stands
    handler = _HANDLER(_on_abort)
    _installed.append((libc, handler))
    # Python's signal module cannot do this: its handlers run later, in the main thread,
    # and abort() does not wait for them
    libc.signal(signal.SIGABRT, ctypes.cast(handler, ctypes.c_void_p))


def _on_abort(signum: int) -> None:
    # runs on the thread that called abort() (JAX's coordination client), Python's lock taken
    line = lost_line()
    if line is None:  # the service answers: a crash of this process's own, as before
        libc, _ = _installed[0]
        libc.signal(signum, ctypes.c_void_p(0))  # SIG_DFL: abort() raises again and ends it
        return
    leaving()
    from resihp_jax.runtime.recovery.host_copies import dump_active, prog  # noqa: PLC0415

    print(f"{prog()}: {line}; exiting with {HUNG_EXIT} so the job restarts",
          file=sys.stderr, flush=True)
    dump_active("the job's coordination service is gone")
    os._exit(HUNG_EXIT)


def _service_address() -> str | None:
    try:
        from jax._src import distributed  # noqa: PLC0415 - only once JAX joined a job
    except ImportError:
        return None
    state = distributed.global_state
    return state.coordinator_address if state.client is not None else None

