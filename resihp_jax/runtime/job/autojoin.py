"""Joining the job at `import resihp_jax`, so that a user's script runs unchanged as a job's
process: imports, model built, `rh.fit`, with no `rh.join_job()` line.

`jax.distributed.initialize` must come before anything starts a JAX backend, and building a
model does; the script's `import resihp_jax` comes before it. So a process `resihp launch`
started (RESIHP_COORDINATOR, RESIHP_NUM_PROCESSES), a Kubernetes pod with the same
variables, or one task of several in a SLURM step (srun) or an Open MPI job only connects to
its coordination service here (no backend starts). Nothing happens in a plain process, in
the `resihp` CLI (`resihp train` joins from its flags, `resihp launch` must never join), or
with RESIHP_JOIN_ON_IMPORT=0. A failure to join ends the process as `rh.join_job()` would.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping, Sequence

from resihp_jax.env_vars import JOB_SPEC_ENV, JOIN_ON_IMPORT_ENV
from resihp_jax.errors import ResihpError
from resihp_jax.runtime.job.distributed import JobSpec, job_spec

_CLI_MODULE = "resihp_jax.cli"
_CLI_SCRIPT = "resihp"  # the console script (pyproject's [project.scripts])


def started_as_cli(argv: Sequence[str], orig_argv: Sequence[str]) -> bool:
    """This interpreter runs the `resihp` command (its script, or python -m resihp_jax.cli)."""
    if argv and Path(argv[0]).name in (_CLI_SCRIPT, f"{_CLI_SCRIPT}.exe"):
        return True
    for i, word in enumerate(orig_argv[:-1]):
        if word == "-m":
            module = orig_argv[i + 1]
            return module == _CLI_MODULE or module.startswith(f"{_CLI_MODULE}.")
    return False


def _several_slurm_tasks(environ: Mapping[str, str]) -> bool:
    # srun sets SLURM_STEP_NUM_TASKS for a step's tasks; a batch script's own shell (also
    # with SLURM_NTASKS and SLURM_PROCID) is not one of them and must not join
    try:
        return int(environ.get("SLURM_STEP_NUM_TASKS") or 1) > 1
    except ValueError:
        return False


def launched_job(environ: Mapping[str, str], argv: Sequence[str],
                 orig_argv: Sequence[str]) -> JobSpec | None:
    """The job to join at import, or None: not launched, the CLI, or opted out. ConfigError
    for a launched process whose variables are bad (as `rh.fit` would raise)."""
    if (environ.get(JOIN_ON_IMPORT_ENV) or "").strip() == "0" or started_as_cli(argv, orig_argv):
        return None
    ours = any(environ.get(JOB_SPEC_ENV[k]) for k in ("coordinator", "num_processes"))
    if not ours and not environ.get("OMPI_MCA_orte_hnp_uri") \
            and not _several_slurm_tasks(environ):
        return None
    spec = job_spec(environ=environ)
    return None if spec.single else spec


def join_if_launched(environ: Mapping[str, str] = os.environ,
                     argv: Sequence[str] | None = None,
                     orig_argv: Sequence[str] | None = None) -> bool:
    """Join the job this process was launched in, if any (see the module docstring); True
    when it joined. A refusal or failure exits the process with one line."""
    argv = sys.argv if argv is None else argv
    orig_argv = getattr(sys, "orig_argv", argv) if orig_argv is None else orig_argv
    prog = (Path(argv[0]).name if argv and argv[0] not in ("", "-c", "-m") else "") \
        or "import resihp_jax"
    try:
        spec = launched_job(environ, argv, orig_argv)
    except ResihpError as err:  # a bad variable: the one line `rh.fit` would give
        from resihp_jax.runtime.job.exits import USER_ERROR  # noqa: PLC0415

        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        os._exit(USER_ERROR)
    if spec is None:
        return False
    from resihp_jax.runtime.job.deadline import Ladder  # noqa: PLC0415
    from resihp_jax.runtime.job.distributed import initialize  # noqa: PLC0415
    from resihp_jax.runtime.job.exits import run_as_job_process  # noqa: PLC0415 - JAX

    ladder = Ladder()  # the timeouts `rh.join_job()` joins with
    run_as_job_process(lambda: initialize(spec, ladder.init_timeout_s,
                                          ladder.heartbeat_timeout_s), prog)
    return True
