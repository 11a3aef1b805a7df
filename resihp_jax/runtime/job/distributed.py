"""One process of a multi-controller job: who it is, and joining the job.

A job is the coordinator address, the number of processes and this process's id, from
flags, from the matching RESIHP_* variables, or, with none given, from the cluster's own
environment through JAX's auto-detection (SLURM, Open MPI; Kubernetes needs the `kubernetes`
package, so our Kubernetes example sets the variables). The host id is the stable name the
health record uses: a process's JAX id is renumbered on every relaunch, its host is not.
Everything here but `initialize` runs before JAX is imported, so a bad value is reported
before any device starts.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from resihp_jax.env_vars import EXTERNAL_SERVICE_ENV, JOB_SPEC_ENV, JOIN_ON_IMPORT_ENV
from resihp_jax.errors import ConfigError
from resihp_jax.runtime.job.coordinator import guard_coordinator_loss

# a cluster that JAX's `jax.distributed.initialize()` detects by itself, by its variables
_CLUSTERS = {"SLURM": ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID"),
             "Open MPI": ("OMPI_MCA_orte_hnp_uri",)}
# the variables that say which job this process joins (the host id is its own)
_JOIN_VARS = tuple(JOB_SPEC_ENV[k] for k in ("coordinator", "num_processes", "process_id"))
_LOCAL_RANK = ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK")
_ADDRESS_RE = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:(\d{1,5})$")


@dataclass(frozen=True)
class JobSpec:
    """How this process joins its job (`single` when it is the whole job)."""
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    host_id: str = ""
    cluster: str | None = None  # detected cluster whose variables JAX reads itself

    @property
    def single(self) -> bool:
        # a job's process is one even when it is the job's last (a relaunch on one survivor):
        # it joins, reads the job's directory and plans for the devices it has
        return self.cluster is None and self.coordinator is None and \
            (self.num_processes or 1) == 1

    def describe(self) -> str:
        if self.single:
            return "one process"
        if self.cluster is not None:
            return f"a {self.cluster} job (auto-detected), host {self.host_id}"
        return (f"process {self.process_id} of {self.num_processes} (coordinator "
                f"{self.coordinator}), host {self.host_id}")


def job_spec(coordinator: str | None = None, num_processes: int | None = None,
             process_id: int | None = None, host_id: str | None = None,
             environ: Mapping[str, str] = os.environ) -> JobSpec:
    """The job this process belongs to, from the values given, else the RESIHP_* variables,
    else the cluster's own (auto-detected); ConfigError naming the first bad value."""
    coordinator = coordinator or environ.get(JOB_SPEC_ENV["coordinator"]) or None
    num = _int_value(num_processes, "--num-processes", environ, "num_processes")
    pid = _int_value(process_id, "--process-id", environ, "process_id")
    host = host_id or environ.get(JOB_SPEC_ENV["host_id"]) or default_host_id(environ)
    if not re.fullmatch(r"[A-Za-z0-9_.:\-]{1,64}", host):
        raise ConfigError(f"--host-id={host!r}: use 1-64 letters, digits, '_', '.', ':' or '-'")
    given = {"--coordinator": coordinator, "--num-processes": num, "--process-id": pid}
    if all(v is None for v in given.values()):
        return JobSpec(host_id=host, cluster=detected_cluster(environ))
    if num == 1 and coordinator is None and pid in (None, 0):
        return JobSpec(num_processes=1, process_id=0, host_id=host)
    missing = [flag for flag, value in given.items() if value is None]
    if missing:
        raise ConfigError(f"a job of several processes needs --coordinator, --num-processes "
                          f"and --process-id (or {', '.join(f'${v}' for v in _JOIN_VARS)}); "
                          f"missing: {', '.join(missing)}")
    assert num is not None and pid is not None and coordinator is not None
    if num < 1:
        raise ConfigError(f"--num-processes={num}: must be >= 1")
    if not 0 <= pid < num:
        raise ConfigError(f"--process-id={pid}: valid are 0..{num - 1} (--num-processes={num})")
    match = _ADDRESS_RE.match(coordinator)
    if not match or not 0 < int(match.group(1)) < 65536:
        raise ConfigError(f"--coordinator={coordinator!r}: expected HOST:PORT with a port in "
                          "1..65535, e.g. 10.0.0.1:8476")
    return JobSpec(coordinator, num, pid, host)


def _int_value(flag_value: int | None, flag: str, environ: Mapping[str, str],
               key: str) -> int | None:
    if flag_value is not None:
        return flag_value
    text = environ.get(JOB_SPEC_ENV[key])
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"${JOB_SPEC_ENV[key]}={text!r} (for {flag}): expected an integer"
                          ) from None


def detected_cluster(environ: Mapping[str, str]) -> str | None:
    """The cluster whose variables say this is one process of several, if any."""
    for name, variables in _CLUSTERS.items():
        if all(environ.get(v) for v in variables):
            if name == "SLURM" and environ.get("SLURM_NTASKS") == "1":
                return None  # a one-task allocation is a plain single process
            return name
    return None


def default_host_id(environ: Mapping[str, str]) -> str:
    host = re.sub(r"[^A-Za-z0-9_.\-]", "-", socket.gethostname())[:48] or "host"
    rank = next((environ[v] for v in _LOCAL_RANK if environ.get(v)), None)
    return f"{host}:{rank}" if rank is not None else host


def initialize(spec: JobSpec, init_timeout_s: int, heartbeat_timeout_s: int) -> None:
    """Join the job (a no-op for a single process). CPU devices talk through gloo; on GPUs
    the collectives are NCCL's, set up by JAX. The timeouts come from the job's ladder
    (see timeouts.py): a process that misses heartbeats for longer than a hung step may
    take is declared dead by the coordination service."""
    if spec.single:
        return
    import jax  # noqa: PLC0415 - JAX starts here, after every argument was checked

    if jax.distributed.is_initialized():
        return  # the script joined already (rh.join_job), before it built its model
    from jax._src import xla_bridge  # noqa: PLC0415

    if xla_bridge.backends_are_initialized():
        raise ConfigError(f"this process is {spec.describe()}, but JAX started before it "
                          "joined the job: import resihp_jax before anything uses JAX (it "
                          "joins the job then), or call rh.join_job() first (with "
                          f"{JOIN_ON_IMPORT_ENV}=0)")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = dict(initialization_timeout=init_timeout_s,
                  heartbeat_timeout_seconds=heartbeat_timeout_s)
    external = os.environ.get(EXTERNAL_SERVICE_ENV) == "1"
    with _without_own_service(external):
        if spec.cluster is not None:
            jax.distributed.initialize(**kwargs)
        else:
            jax.distributed.initialize(spec.coordinator, spec.num_processes, spec.process_id,
                                       **kwargs)
    # JAX aborts every process whose coordination service goes away: a lost process 0
    # becomes a step failure with one line instead (coordinator.py)
    guard_coordinator_loss(hosted_by_process_0=not external)


@contextlib.contextmanager
def _without_own_service(external: bool) -> Iterator[None]:
    """Within, with `external`: process 0 joins a coordination service that runs elsewhere
    (`resihp launch` hosts it) instead of starting one. JAX aborts every process the moment
    the service goes away, so a service inside process 0 would take the survivors down with
    it before they write their copies of the last step (host_copies.py)."""
    if not external:
        yield
        return
    from jax._src import distributed as jax_distributed  # noqa: PLC0415

    lib = jax_distributed._jax
    original = lib.get_distributed_runtime_service
    lib.get_distributed_runtime_service = lambda *args, **kwargs: None
    try:
        yield
    finally:
        lib.get_distributed_runtime_service = original


def start_service(address: str, num_processes: int, heartbeat_timeout_s: int = 600,
                  shutdown_timeout_s: int = 300) -> Any:
    """A JAX coordination service for a job whose processes run with EXTERNAL_SERVICE_ENV=1;
    call `.shutdown()` on it when the job's processes have ended."""
    from jax._src.lib import _jax  # noqa: PLC0415 - no backend starts

    return _jax.get_distributed_runtime_service(address, num_processes,
                                                heartbeat_timeout=heartbeat_timeout_s,
                                                shutdown_timeout=shutdown_timeout_s)
