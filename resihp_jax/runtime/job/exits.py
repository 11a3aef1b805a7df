"""How one process of a job ends: at once, with an exit code that tells the job what to do.

A normal interpreter exit would wait on JAX's distributed shutdown barrier, which the peers
of a failed process never reach: the job would hang instead of restarting. So a job process
reports its error in one line and leaves with `os._exit`, with one of the codes of
`EXIT_CODES` (docs/DESIGN.md, "How a job process ends", has what restarts each): 0 trained;
1 crashed (restart, counted); 2 USER_ERROR, refused input (never restarted); 74
PREEMPTED_EXIT, SIGTERM (requeue, not counted); 75 HUNG_EXIT, a step failed or hung, process
0 died (coordinator.py) or `resihp launch` ended the job after another process failed
(env_vars.PEER_LOST_ENV): restart, this process not to blame; 76/77 (HostsLeftOut) a
re-plan left a slow host out (76 on it, 77 elsewhere): restart without it. A process killed
by a signal shows as 128+N in a shell or srun (137: SIGKILL).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

from resihp_jax.env_vars import PEER_LOST_ENV
from resihp_jax.errors import HostsLeftOut, JobStepFailed, Preempted, ResihpError
from resihp_jax.runtime.job.coordinator import HUNG_EXIT, leaving, lost_line
# what host_copies.py exits with on SIGTERM, and where resihp launch names the failure that
# ends a job before its SIGTERM (from a JAX-free module: this one imports no JAX)
from resihp_jax.runtime.recovery.preemption import PREEMPTED_EXIT, peer_lost

USER_ERROR = 2
# how long a process whose collective broke waits for the launcher to name the failure: its
# poll (0.05 s by default) and a busy machine's delay, well inside the grace period it gives
VERDICT_WAIT_S = 5.0
EXIT_CODES = {0: "finished", 1: "crashed", USER_ERROR: "refused its input",
              PREEMPTED_EXIT: "preempted (SIGTERM)", HUNG_EXIT: "a step failed or hung",
              HostsLeftOut.LEFT_OUT_EXIT: "left out by a re-plan (slow host)",
              HostsLeftOut.REPLAN_EXIT: "restarting without a slow host"}


def launcher_verdict(wait_s: float = VERDICT_WAIT_S, poll_s: float = 0.05,
                     environ: dict[str, str] | None = None,
                     clock: Callable[[], float] = time.monotonic) -> str | None:
    """'the job is ending: <failure>' once `resihp launch` has named the failure that ends the
    job (PEER_LOST_ENV); None outside a launched job, or if it names none within `wait_s`.

    A peer's death breaks this process's collective at once (its sockets close), a little
    before the launcher, polling its processes, notices it: without this wait the survivors
    would each print a collective's error instead of the one cause. The launcher writes the
    name before its SIGTERM, so the SIGTERM ends the wait too (and must not end the process
    unheard meanwhile)."""
    path = (os.environ if environ is None else environ).get(PEER_LOST_ENV)
    if not path:
        return None
    woken = threading.Event()
    old = None
    if threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGTERM, lambda *_: woken.set())
    try:
        deadline = clock() + wait_s
        while True:
            text = peer_lost(environ)
            if text or woken.is_set() or clock() >= deadline:
                return f"the job is ending: {text}" if text else None
            woken.wait(poll_s)
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def run_as_job_process(body: Callable[[], Any], prog: str) -> int:
    """Run `body` as one process of a job: 0 when it returns; on any error, exit the process
    at once with the code its end calls for. `prog` names the process in its messages."""
    from resihp_jax.runtime.recovery.host_copies import set_prog  # noqa: PLC0415 - JAX

    set_prog(prog)  # the exit paths elsewhere (SIGTERM, a lost coordinator) name it the same
    # a process may be killed at any moment: what it printed must already be in its log
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    try:
        body()
        return 0
    except ResihpError as err:
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        code = USER_ERROR
    except Preempted as err:
        print(f"{prog}: {err}", file=sys.stderr, flush=True)
        code = PREEMPTED_EXIT
    except JobStepFailed as err:
        leaving()  # the coordinator guard may be saying it already: then it alone speaks
        # a step that broke because process 0 died is named by what happened to it; one that
        # broke because a peer died, by the launcher (which knows who) once it has noticed
        named = lost_line() or launcher_verdict()
        print(f"{prog}: {named or err}; exiting with {HUNG_EXIT} so the job restarts",
              file=sys.stderr, flush=True)
        code = HUNG_EXIT
    except HostsLeftOut as err:
        import jax  # noqa: PLC0415

        print(f"{prog}: {err}", file=sys.stderr, flush=True)
        code = (err.LEFT_OUT_EXIT if jax.process_index() in err.processes
                else err.REPLAN_EXIT)
    except BaseException:  # noqa: BLE001 - any crash must end the process, not hang it
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    os._exit(code)
