"""What a local launch (`resihp launch`: supervisor.py) is given (`LaunchConfig`) and what it
reports: each failure it saw (`Failure`) and the job's account (`Summary`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from resihp_jax.errors import ConfigError
from resihp_jax.faults.processes import Fault
from resihp_jax.runtime.job import accelerators


@dataclass(frozen=True)
class LaunchConfig:
    procs: int
    devices_per_proc: int
    checkpoint_dir: Path
    train_args: tuple[str, ...]
    faults: tuple[Fault, ...] = ()
    max_restarts: int = 8
    startup_s: float = 600.0  # initialization, restore and first compile of an incarnation
    stale_s: float = 2.0  # a heartbeat older than this: the process is frozen
    poll_s: float = 0.05
    # after a failure the others get SIGTERM and this long to write their copies of the
    # last step (host_copies.py) before SIGKILL, as a cluster's grace period allows
    grace_s: float = 60.0
    # an excluded host returns (repaired) once the job is this many steps past its
    # exclusion: the job restarts to take it in (a planned restart; None: never)
    readmit_after_steps: int | None = None
    # the user's own command, run as each process instead of `resihp train train_args`; it
    # learns its place in the job from our variables (env_vars.py)
    command: tuple[str, ...] | None = None
    # keep the likely next incarnation (one process fewer) started and compiled (standby.py)
    standby: bool = True
    # a kill or hang due at a step waits until the standby is ready, as a failure in a long
    # job finds it (benchmarks; the job must run long enough for it)
    faults_wait_for_standby: bool = False
    # devices_per_proc fake CPU devices, or of the node's `gpus` (p{i} always on the i-th share)
    platform: str = "cpu"
    gpus: tuple[str, ...] = ()
    # `--metrics`: every process's run writes there (METRICS_ENV), the supervisor its relaunches
    metrics: tuple[str, ...] = ()
    # a replica of a job of several (replica_job.py): its variables, and a failed process
    # replaced (the replica restarts whole, its mesh its peers') instead of its host excluded
    extra_env: tuple[tuple[str, str], ...] = ()
    replace_failed: bool = False

    @property
    def keeps_standby(self) -> bool:
        # on GPUs a standby would hold CUDA contexts and its compiled programs' memory on
        # GPUs the running job uses (it cannot know, before its go, whose GPUs it takes
        # over): no standby there; a relaunch starts fresh processes
        return self.standby and self.platform == "cpu"

    def process_env(self, host: str) -> dict[str, str]:
        """The device variables of the process on `host` (p{i}; a standby's are CPU-only)."""
        index = int(host[1:]) if re.fullmatch(r"p\d+", host) else 0
        share = accelerators.gpu_share(self.gpus, self.devices_per_proc, index)
        return accelerators.process_env(self.platform, self.devices_per_proc, share)

    def __post_init__(self) -> None:
        if self.platform not in ("cpu", "gpu"):
            raise ConfigError(f"platform={self.platform!r}: valid are cpu, gpu")
        if self.readmit_after_steps is not None and self.readmit_after_steps < 1:
            raise ConfigError(f"--readmit-after={self.readmit_after_steps}: must be >= 1")
        if self.procs < 1 or self.devices_per_proc < 1:
            raise ConfigError(f"--procs={self.procs} and --devices-per-proc="
                              f"{self.devices_per_proc}: both must be >= 1")
        for fault in self.faults:
            if not fault.by_rank and not 0 <= fault.process < self.procs:
                raise ConfigError(f"--{fault.kind} names process {fault.process}; valid: 0.."
                                  f"{self.procs - 1}")
        if self.platform == "gpu":
            accelerators.check_fits(self.gpus, self.procs, self.devices_per_proc)


@dataclass
class Failure:
    kind: str  # died | hung | excluded (a re-plan left slow hosts out) | readmit
    host: str | None  # the culprit, when known
    step: int  # the job's last completed step when it was seen
    detect_s: float | None  # from the injected fault to detection (None: not injected)
    detail: str
    exit_code: int | None = None  # the culprit's, when it exited
    end_s: float = 0.0  # from detection until every process had ended (copies written)
    stalled_s: float | None = None  # hung: how long the job's step had not advanced
    hosts: tuple[str, ...] = ()  # every host to exclude, when several (else `host`)

    def excluded(self) -> tuple[str, ...]:
        """The hosts the relaunch runs without."""
        return self.hosts or ((self.host,) if self.host is not None else ())


@dataclass
class Summary:
    restarts: int = 0
    steps_lost: int = 0
    recovery_s: list[float] = field(default_factory=list)
    detect_s: list[float] = field(default_factory=list)
    final_step: int = 0
    plans: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    phases: list[dict] = field(default_factory=list)  # each relaunch's first-step breakdown
    sources: list[str] = field(default_factory=list)  # each incarnation's state: its origin
    restored: list[int] = field(default_factory=list)  # each incarnation's first step
    injected: list[str] = field(default_factory=list)  # each fault as it was injected
    relaunched_by: list[str] = field(default_factory=list)  # each relaunch: standby | fresh
    standby_rss_mb: list[float] = field(default_factory=list)  # each promoted standby's memory
    # seconds a relaunch waited for a standby that took over before it was ready
    standby_waits_s: list[float] = field(default_factory=list)
    # each slowdown once lifted (ProcessFaults.throttled)
    throttled: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"restarts": self.restarts, "steps_lost": self.steps_lost,
                "recovery_s": [round(x, 3) for x in self.recovery_s],
                "detect_s": [round(x, 3) for x in self.detect_s],
                "final_step": self.final_step, "plans": self.plans, "sources": self.sources,
                "relaunched_by": self.relaunched_by,
                "standby_waits_s": [round(x, 3) for x in self.standby_waits_s],
                # executables each relaunch built on its way to its first step
                "relaunch_compiles": [int(p.get("compiles", -1)) for p in self.phases]}
