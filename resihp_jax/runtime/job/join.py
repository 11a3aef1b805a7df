"""This process's place in its job, after joining it: which host each process is, which
devices the job's health record leaves usable, and which it saw slow."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np

from resihp_jax.env_vars import EXPECT_PLATFORM_ENV
from resihp_jax.errors import ConfigError
from resihp_jax.runtime.recovery import health_record
from resihp_jax.runtime.job.deadline import Ladder
from resihp_jax.runtime.job.distributed import JobSpec, initialize

_HOST_BYTES = 64


@dataclass(frozen=True)
class Job:
    spec: JobSpec
    hosts: tuple[str, ...]  # host id of each JAX process index
    record: health_record.HealthRecord = field(default_factory=health_record.HealthRecord)

    @property
    def process_index(self) -> int:
        import jax  # noqa: PLC0415

        return jax.process_index()

    @property
    def primary(self) -> bool:
        return self.process_index == 0

    def usable_devices(self) -> list:
        """Every device of the job whose host the health record does not exclude."""
        import jax  # noqa: PLC0415

        return [d for d in jax.devices() if self.hosts[d.process_index] not in
                self.record.excluded]

    def excluded_here(self) -> list[str]:
        return sorted(h for h in self.hosts if h in self.record.excluded)

    def record_slowdown(self, device_ids: tuple[int, ...], factor: float,
                        checkpoint_dir: str | Path) -> None:
        """Process 0 notes in the health record that these devices' hosts ran `factor`
        slow, so the next incarnation plans for them from its first step."""
        if not self.primary:
            return
        import jax  # noqa: PLC0415

        process_of = {d.id: d.process_index for d in jax.devices()}
        for device in device_ids:
            host = self.hosts[process_of[device]]
            self.record.slow[host] = max(factor, self.record.slow.get(host, 1.0))
        health_record.save(self.record, checkpoint_dir)

    def record_exclusion(self, processes: tuple[int, ...], reason: str, step: int,
                         checkpoint_dir: str | Path) -> None:
        """Process 0 notes in the health record that these processes' hosts are excluded,
        so the next incarnation (from `resihp launch`, SLURM or Kubernetes) starts without
        them."""
        if not self.primary:
            return
        for process in processes:
            self.record.exclude(self.hosts[process], reason, step)
        health_record.save(self.record, checkpoint_dir)

    def slow_devices(self) -> dict[int, float]:
        """{device id: slowdown} of devices on hosts the health record saw slow."""
        import jax  # noqa: PLC0415

        return {int(d.id): self.record.slow[self.hosts[d.process_index]]
                for d in jax.devices() if self.hosts[d.process_index] in self.record.slow}


def join(spec: JobSpec, ladder: Ladder, checkpoint_dir: str | Path | None) -> Job:
    """Join the job (jax.distributed for several processes) and read its health record."""
    initialize(spec, ladder.init_timeout_s, ladder.heartbeat_timeout_s)
    check_platform()
    return Job(spec, _all_hosts(spec.host_id), health_record.load(checkpoint_dir))


def check_platform(environ: Mapping[str, str] = os.environ) -> None:
    """ConfigError (exit 2: a restart cannot help) when $RESIHP_EXPECT_PLATFORM names a
    platform (gpu, tpu, cpu) other than the one JAX started on."""
    expected = (environ.get(EXPECT_PLATFORM_ENV) or "").strip().lower()
    if not expected:
        return
    import jax  # noqa: PLC0415

    found = jax.default_backend()
    if found == expected or (expected == "gpu" and found in ("cuda", "rocm")):
        return
    where = environ.get("VIRTUAL_ENV") or sys.prefix
    raise ConfigError(
        f"${EXPECT_PLATFORM_ENV}={expected}: this job asked for {expected} devices, but JAX "
        f"found only {len(jax.local_devices())} {found} device(s) on this process. Install a "
        f"{expected} build of JAX in the environment ({where}; e.g. pip install "
        f"'jax[cuda12]'), check the job's allocation (e.g. --gpus-per-node), or run on CPUs "
        f"with examples/slurm/train-cpu.sbatch")


def _all_hosts(host: str) -> tuple[str, ...]:
    """Every process's host id, in process-index order (one small all-gather)."""
    import jax  # noqa: PLC0415

    if jax.process_count() == 1:
        return (host,)
    from jax.experimental import multihost_utils  # noqa: PLC0415

    mine = np.zeros(_HOST_BYTES, np.uint8)
    raw = host.encode()[:_HOST_BYTES]
    mine[:len(raw)] = np.frombuffer(raw, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(mine))
    return tuple(bytes(row).rstrip(b"\0").decode() for row in rows.reshape(-1, _HOST_BYTES))


def join_job(checkpoint_dir: str | Path | None = None, ladder: Ladder | None = None) -> Job:
    """Join the job this process was started in (`resihp launch`, SLURM, Kubernetes: read
    from the RESIHP_* variables or the cluster's own) before anything uses JAX; alone, a job
    of one. `import resihp_jax` has already connected a launched process (autojoin.py), so a
    script needs no call; one that opted out (RESIHP_JOIN_ON_IMPORT=0) calls it before it
    builds its model. Calling it again returns the same job."""
    from resihp_jax.runtime.job.distributed import job_spec  # noqa: PLC0415
    from resihp_jax.runtime.job.exits import run_as_job_process  # noqa: PLC0415

    spec, ladder = job_spec(), ladder or Ladder()
    if spec.single:
        return join(spec, ladder, checkpoint_dir)
    joined: list[Job] = []
    # a refusal (a GPU job that found only CPU devices) ends the process with the job's
    # exit code for it (2: not restarted), not as a crash; named after the script
    run_as_job_process(lambda: joined.append(join(spec, ladder, checkpoint_dir)),
                       Path(sys.argv[0]).name or "rh.join_job")
    return joined[0]
