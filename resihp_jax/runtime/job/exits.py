"""How one process of a job ends: at once, with an exit code that tells the job what to do.

A normal interpreter exit would wait on JAX's distributed shutdown barrier, which the peers
of a failed process never reach: the job would hang instead of restarting. So a job process
reports its error in one line and leaves with `os._exit`: 2 for refused input (a restart
cannot fix it), HUNG_EXIT (75) for a failed or hung step, 76/77 for a re-plan that leaves a
slow host out, 1 for anything else. A body that returns ends the process as usual.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Callable

from resihp_jax.errors import HostsLeftOut, JobStepFailed, ResihpError
from resihp_jax.runtime.job.watchdog import HUNG_EXIT


def run_as_job_process(body: Callable[[], Any], prog: str) -> int:
    """Run `body` as one process of a job: 0 when it returns; on any error, exit the process
    at once with the code its end calls for. `prog` names the process in its messages."""
    # a process may be killed at any moment: what it printed must already be in its log
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    try:
        body()
        return 0
    except ResihpError as err:
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        code = 2
    except JobStepFailed as err:
        print(f"{prog}: {err}; exiting so the job restarts", file=sys.stderr, flush=True)
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
