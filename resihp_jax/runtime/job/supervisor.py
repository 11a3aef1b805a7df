"""The local supervisor behind `resihp launch`: start N processes of one multi-controller
job, watch them, and do for a local job what a cluster's restart policy does for a real one.

A process that exits is seen at the next poll. A hung one (alive, no progress) is caught
when the job's step has not advanced within the deadline its processes publish (a multiple
of the predicted healthy time of the step in flight, with a floor); the culprit is the
process whose heartbeat went stale (frozen), the others being merely blocked in collectives.
Either way every process is ended, the culprit's host is recorded as excluded in the job's
health record, and the job is relaunched on the survivors, which restore the newest
checkpoint into the plan the scheduler picks for them.

While an incarnation of n >= 2 processes runs, a warm standby of n-1 processes waits
beside it (standby.py): started with the job's first incarnation, and after a relaunch once
the relaunched incarnation has trained its first step, so that it never competes with a
relaunch's critical path (its restore and first step). A failure that leaves n-1 usable hosts
promotes it: the supervisor ends the incarnation as always (its survivors write their
copies), then gives the standby the word, and the standby restores and trains with the
programs it compiled while it waited. Any other failure, or a standby that died, relaunches
fresh processes.

Each process gets its devices from the supervisor's environment, never from a JAX backend
of its own (accelerators.py): on a GPU node its share of the GPUs (CUDA_VISIBLE_DEVICES, kept
by host across relaunches, so a survivor stays on its GPUs) and no standby (it would hold GPU
memory beside the job before its go); elsewhere fake CPU devices.

Faults for testing (`Fault`): kill (SIGKILL), hang (SIGSTOP), slow (a CPU quota from
outside, see `Throttle`), each once every process has finished a given step. The processes
wait after that step at its fault gate (heartbeat.py) until the supervisor has injected its
faults, so a fault lands on the step asked, never on a later one the job reached before a
poll saw the step. Time is injected (`clock`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from resihp_jax.errors import ConfigError, HostsLeftOut
from resihp_jax.metrics import Destination, Metrics, parse_destinations
from resihp_jax.metrics.entry import relaunch_entry
from resihp_jax.runtime.job import accelerators, distributed, heartbeat, standby
from resihp_jax.runtime.recovery import health_record
from resihp_jax.faults.throttle import Throttle
from resihp_jax.runtime.job import priority
from resihp_jax.runtime.job.exits import EXIT_CODES, PEER_LOST_ENV, USER_ERROR
from resihp_jax.runtime.job.coordinator import HUNG_EXIT

# the job's directory, for a user's own command (rh.fit checkpoints there by default)
CHECKPOINT_DIR_ENV = "RESIHP_CHECKPOINT_DIR"
# a node-local directory for the survivors' copies of a user's command (rh.fit; see
# recovery/local_copies.py); `resihp train` takes --local-copy-dir
LOCAL_COPY_DIR_ENV = "RESIHP_LOCAL_COPY_DIR"
PLANNED_EXITS = frozenset({HostsLeftOut.LEFT_OUT_EXIT, HostsLeftOut.REPLAN_EXIT})
# the metrics destinations of `resihp launch --metrics`, one a line, for every process's run
# (`resihp train` and rh.fit write there unless given their own)
METRICS_ENV = "RESIHP_METRICS"


def launched_metrics(environ: Any = None) -> tuple[str, ...] | None:
    """The metrics destinations `resihp launch --metrics` gave this process, if any."""
    text = (os.environ if environ is None else environ).get(METRICS_ENV, "")
    found = tuple(line for line in text.splitlines() if line.strip())
    return found or None


def _launch_destinations(metrics: tuple[str, ...]) -> tuple[Destination, ...]:
    """Where the supervisor writes its relaunches: a TensorBoard directory's `launch` run
    (beside the job's, never in the same files), W&B runs named `launch`; JSON lines files
    hold steps only."""
    out = []
    for d in parse_destinations(metrics, "--metrics"):
        if d.kind == "tensorboard":
            out.append(Destination("tensorboard", str(Path(d.target) / "launch")))
        elif d.kind == "wandb":
            out.append(d)
    return tuple(out)


@dataclass(frozen=True)
class Fault:
    kind: str  # kill | hang | slow
    process: int  # index in the first incarnation (host id f"p{process}"), or see by_rank
    step: int
    factor: float = 1.0  # slow only
    until: int | None = None  # slow only: the quota is lifted when the job reaches this step
    by_rank: bool = False  # `process` is a rank in the incarnation running at `step`

    def host_in(self, live: list[str]) -> str:
        """The host this fault strikes among the running incarnation's `live` hosts."""
        return live[self.process % len(live)] if self.by_rank else f"p{self.process}"

    def describe(self) -> str:
        who = f"rank {self.process}" if self.by_rank else f"process p{self.process}"
        what = f"slow x{self.factor:g}" if self.kind == "slow" else self.kind
        until = f" until step {self.until}" if self.until is not None else ""
        return f"{what} {who} at step {self.step}{until}"


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
    # the user's own command (e.g. python my_train.py ARGS), run as each process instead of
    # `resihp train train_args`; it learns its place in the job from the RESIHP_* variables
    command: tuple[str, ...] | None = None
    # keep the likely next incarnation (one process fewer) started and compiled (standby.py)
    standby: bool = True
    # a kill or hang due at a step waits until the standby is ready, as a failure in a long
    # job finds it (benchmarks; the job must run long enough for it)
    faults_wait_for_standby: bool = False
    # "cpu": devices_per_proc fake CPU devices per process; "gpu": devices_per_proc of the
    # node's `gpus` per process (CUDA_VISIBLE_DEVICES), process p{i} always on the i-th share
    platform: str = "cpu"
    gpus: tuple[str, ...] = ()
    # metrics destinations (`--metrics`): every process's run writes there (METRICS_ENV), and
    # the supervisor each relaunch: its cause, seconds to recover, steps lost
    metrics: tuple[str, ...] = ()

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
            if fault.by_rank:
                continue
            if not 0 <= fault.process < self.procs:
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
    # each slowdown once lifted: how it was applied (throttle.py's mode), the slowed
    # process's busy seconds meanwhile and the seconds it was held stopped
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Supervisor:
    def __init__(self, config: LaunchConfig, out: TextIO = sys.stderr,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.out, self.clock = config, out, clock
        self.summary = Summary()
        self._fired: set[Fault] = set()
        self._fault_time: dict[str, float] = {}  # host -> when its fault was injected
        self._throttles: dict[Fault, Throttle] = {}
        self._lifted: set[Fault] = set()
        self._last_detected = 0.0  # when the last failure was detected
        self._record = health_record.HealthRecord()  # as the running incarnation read it
        self._service = None  # the running incarnation's coordination service
        self._incarnation = 0
        self._standby: standby.Standby | None = None
        # a standby promoted before it was ready, and when: reported once it is
        self._promoted_unready: tuple[standby.Standby, float] | None = None
        self._steps_lost = 0  # by the last relaunch
        self.metrics: Metrics | None = None  # where relaunches go (LaunchConfig.metrics)

    # ---- one incarnation -----------------------------------------------------------------
    def _spawn(self, hosts: list[str], beat_dir: Path) -> dict[str, subprocess.Popen]:
        logs = [self._log(f"incarnation{self._incarnation}-{host}") for host in hosts]
        procs, self._service = self._start(hosts, beat_dir, logs)
        return dict(zip(hosts, procs))

    def _log(self, name: str) -> Path:
        logs = self.config.checkpoint_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        return logs / f"{name}.log"

    def _start(self, hosts: list[str], beat_dir: Path, logs: list[Path],
               extra_env: dict[str, str] | None = None) -> tuple[list[subprocess.Popen], Any]:
        """Processes `hosts` of one job with their own coordination service."""
        cfg, port = self.config, free_port()
        # the job's coordination service lives here, not in process 0: JAX aborts every
        # process when the service goes away, which would cost the survivors' copies
        service = distributed.start_service(f"127.0.0.1:{port}", len(hosts))
        if cfg.faults:
            extra_env = {heartbeat.GATES_ENV: str(self._gates_dir()), **(extra_env or {})}
        env = dict(os.environ, **{heartbeat.ENV_VAR: str(beat_dir),
                                  distributed.EXTERNAL_SERVICE_ENV: "1",
                                  PEER_LOST_ENV: str(self._peer_lost_file())},
                   **(extra_env or {}))
        if cfg.metrics:
            env[METRICS_ENV] = "\n".join(cfg.metrics)
        procs = []
        for index, (host, path) in enumerate(zip(hosts, logs)):
            log = open(path, "w")  # noqa: SIM115
            cmd, own_env = self._command(f"127.0.0.1:{port}", len(hosts), index, host)
            # a process group of its own (signals reach all it starts), in the launcher's
            # session: Linux shares a host's cores out per session first (autogroups), so a
            # session each made every thread a process ran beside its devices (a background
            # compile) take their share, and its probes read it as a slow device
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL,
                                          env={**env, **cfg.process_env(host), **own_env},
                                          process_group=0))
            log.close()
        return procs, service

    # ---- the standby ---------------------------------------------------------------------
    def _start_standby(self, n: int) -> None:
        """A standby for the next incarnation, one process fewer than the `n` running."""
        if not self.config.keeps_standby or n < 2 or self._standby is not None:
            return
        cfg, nxt = self.config, self._incarnation + 1
        go = cfg.checkpoint_dir / "standby" / f"incarnation{nxt}" / standby.GO_FILE
        shutil.rmtree(go.parent, ignore_errors=True)
        go.parent.mkdir(parents=True)
        # placeholder host ids: the go file names the real ones
        names = [f"standby{i}" for i in range(n - 1)]
        logs = [self._log(f"incarnation{nxt}-{name}") for name in names]
        beat_dir = cfg.checkpoint_dir / "heartbeat" / f"incarnation{nxt}"
        procs, service = self._start(names, beat_dir, logs, {standby.ENV_VAR: str(go)})
        # it prepares (starts, joins, compiles) at normal priority, so that a fault soon
        # after finds it ready; once ready it waits on idle cores (`_check_standby`)
        self._standby = standby.Standby(procs, service, go, nxt, logs)

    def _check_standby(self) -> None:
        """A standby that ended on its own is dropped (never counted as a failure); one that
        became ready goes to idle priority: its waiting and its later compiles (the likely
        re-plans) must not take the job's cores (priority.py). A promoted standby that was
        not ready is reported once it is: how long the relaunch waited for it."""
        held = self._standby
        if held is not None and not held.alive():
            codes = [p.poll() for p in held.procs]
            print(f"launch: the standby ended by itself (exit codes {codes}); the next "
                  "relaunch starts fresh processes", file=self.out)
            self._drop_standby()
        elif held is not None and not held.idle and held.ready():
            held.idle = True
            for proc in held.procs:
                why = priority.background(proc.pid)
                if why is not None:
                    print(f"launch: the ready standby waits at normal priority ({why})",
                          file=self.out)
                    break
        waited = self._promoted_unready
        if waited is not None and waited[0].ready():
            self._promoted_unready = None
            seconds = self.clock() - waited[1]
            self.summary.standby_waits_s.append(seconds)
            print(f"launch: the standby was ready {seconds:.1f} s after it took over",
                  file=self.out)

    def _drop_standby(self) -> None:
        if self._standby is not None:
            self._standby.kill()
            self._standby = None

    def _relaunch(self, live: list[str], beat_dir: Path) -> dict[str, subprocess.Popen]:
        """The incarnation's processes: the standby promoted when it fits, else new ones."""
        held, self._standby = self._standby, None
        relaunch = self._incarnation > 0
        if held is not None and held.size == len(live) and held.alive():
            state = "ready" if held.ready() else "still preparing: it goes on once ready"
            if not held.ready():
                self._promoted_unready = (held, self.clock())
            print(f"launch: incarnation {self._incarnation} on {', '.join(live)}: the standby "
                  f"takes over ({state})", file=self.out)
            self._service = held.service
            self.summary.relaunched_by.append("standby")
            rss = held.rss_mb()
            if rss is not None:
                self.summary.standby_rss_mb.append(rss)
            return held.promote(live)
        if held is not None:
            print(f"launch: the standby of {held.size} process(es) does not fit "
                  f"{len(live)} usable host(s): starting fresh processes", file=self.out)
            held.kill()
        if relaunch:
            self.summary.relaunched_by.append("fresh")
        return self._spawn(live, beat_dir)

    def _faults_held(self) -> bool:
        """Fail-stop faults wait for a ready standby (faults_wait_for_standby)."""
        if not (self.config.faults_wait_for_standby and self.config.keeps_standby):
            return False
        return self._standby is None or not self._standby.ready()

    def _gates_dir(self) -> Path:
        """The fault gates the processes wait at (heartbeat.py), one per fault's step."""
        return self.config.checkpoint_dir / "fault_gates"

    def _close_gates(self) -> None:
        gates = self._gates_dir()
        shutil.rmtree(gates, ignore_errors=True)
        if self.config.faults:
            gates.mkdir(parents=True)
            for fault in self.config.faults:
                heartbeat.gate_path(gates, fault.step).touch()

    def _open_gates(self, procs: dict[str, subprocess.Popen], step: int) -> bool:
        """Open the gates of steps up to `step` whose faults are injected (or can no longer
        be: their host is not in the job); whether the job waits at the gate of `step`."""
        live, waiting = list(procs), set()
        for fault in self.config.faults:
            if fault not in self._fired and fault.host_in(live) in procs:
                waiting.add(fault.step)
        for fault in self.config.faults:
            if fault.step <= step and fault.step not in waiting:
                heartbeat.gate_path(self._gates_dir(), fault.step).unlink(missing_ok=True)
        return step in waiting

    def _peer_lost_file(self) -> Path:
        """Where `_end` names a failure for the processes it then ends (PEER_LOST_ENV)."""
        return self.config.checkpoint_dir / "peer_lost"

    def _command(self, coordinator: str, n: int, index: int, host: str
                 ) -> tuple[list[str], dict[str, str]]:
        """One process's command line and its own variables: `resihp train` with the job's
        flags, or the user's command with the same facts as RESIHP_* variables."""
        cfg = self.config
        if cfg.command is None:
            return ([sys.executable, "-m", "resihp_jax.cli", "train", *cfg.train_args,
                     "--coordinator", coordinator, "--num-processes", str(n),
                     "--process-id", str(index), "--host-id", host,
                     "--checkpoint-dir", str(cfg.checkpoint_dir), "--resume", "--no-progress"],
                    {})
        env = distributed.ENV
        return list(cfg.command), {
            env["coordinator"]: coordinator, env["num_processes"]: str(n),
            env["process_id"]: str(index), env["host_id"]: host,
            CHECKPOINT_DIR_ENV: str(cfg.checkpoint_dir)}

    def _inject(self, procs: dict[str, subprocess.Popen], step: int) -> None:
        live = list(procs)
        for fault in self.config.faults:
            if fault in self._lifted or fault.until is None or step < fault.until:
                continue
            if fault in self._throttles:  # a slowdown that comes and goes: it goes now
                self._lift(fault)
                self._lifted.add(fault)
                print(f"launch: step {step}: slowdown of {fault.describe()} lifted",
                      file=self.out)
        held = self._faults_held()
        for fault in self.config.faults:
            host = fault.host_in(live)
            if fault in self._fired or host not in procs or step < fault.step:
                continue
            if held and fault.kind != "slow":
                continue
            self._fired.add(fault)
            pid = procs[host].pid
            self._fault_time[host] = self.clock()
            self.summary.injected.append(f"step {step}: {fault.kind} {host}")
            print(f"launch: step {step}: {fault.kind} process {host}"
                  + (f" x{fault.factor:g}" if fault.kind == "slow" else ""), file=self.out)
            if fault.kind == "kill":
                standby.signal_group(pid, signal.SIGKILL)
            elif fault.kind == "hang":
                standby.signal_group(pid, signal.SIGSTOP)
            else:
                self._throttles[fault] = Throttle(pid, fault.factor)

    def _watch(self, procs: dict[str, subprocess.Popen], beat_dir: Path,
               start_step: int) -> tuple[Failure | None, int, dict[str, heartbeat.Beat]]:
        """Until every process exits 0 (None) or one fails; also the job's last step."""
        cfg = self.config
        step, advanced_at, started = start_step, self.clock(), False
        beats: dict[str, heartbeat.Beat] = {}
        while True:
            time.sleep(cfg.poll_s)
            exited = {h: p.returncode for h, p in procs.items() if p.poll() is not None}
            failed = {h: c for h, c in exited.items() if c != 0}
            beats = heartbeat.read(beat_dir)
            now_step = max((b.step for b in beats.values()), default=step)
            if now_step > step:
                if not started:
                    self._first_progress_at = self.clock()
                    self._relaunched(now_step)
                    self._start_standby(len(procs))
                step, advanced_at, started = now_step, self._advanced_at(beats, now_step), True
            self._check_standby()
            if failed and set(failed.values()) <= PLANNED_EXITS:
                # a re-plan left processes out: all exit on their own, those left out with
                # their own code, once their copies are written
                if len(exited) < len(procs) and self.clock() - advanced_at < cfg.startup_s:
                    continue
                return self._left_out(failed, step), step, beats
            if failed:
                failure = self._died(failed, beats, step)
                if failure.kind == "hung":  # the processes' own deadlines caught it first
                    failure.stalled_s = self.clock() - advanced_at
                return failure, step, beats
            if len(exited) == len(procs):
                return None, step, beats
            finished = _finished_by_all(beats, procs, start_step)
            self._inject(procs, finished)
            if self._open_gates(procs, finished):
                # every process waits at the step's gate for a fault held back (a standby
                # not ready yet): the job is not stalled, it is held
                advanced_at = self.clock()
            if started and self._readmission_due(step):
                return Failure("readmit", None, step, None, "excluded host(s) repaired: "
                               "restarting to take them in"), step, beats
            # the deadline the processes publish for the step in flight (from the cost
            # model, with their floor); their own step deadlines use the same figure
            limit = cfg.startup_s if not started else \
                max((b.deadline_s for b in beats.values()), default=cfg.startup_s)
            if self.clock() - advanced_at > limit:
                hung = self._hung(beats, step, limit)
                hung.stalled_s = self.clock() - advanced_at
                return hung, step, beats

    def _relaunched(self, step: int) -> None:
        """The relaunched incarnation trained its first step: write the relaunch."""
        if self.metrics is None or not self.summary.restarts:
            return
        failure = self.summary.failures[-1]
        cause = f"{failure.kind} {failure.host}" if failure.host else failure.kind
        self.metrics.put(relaunch_entry(step, f"{cause}: {failure.detail}",
                                        self._first_progress_at - self._last_detected,
                                        self._steps_lost, self._incarnation))

    def _advanced_at(self, beats: dict[str, heartbeat.Beat], step: int) -> float:
        """When the job reached `step`: when the first process said so, not when this poll
        saw it (a loaded host sees it late, and the processes' own deadlines run from then)."""
        said = [b.since for b in beats.values() if b.step == step and b.since > 0]
        return self.clock() - (max(0.0, time.time() - min(said)) if said else 0.0)

    def _left_out(self, failed: dict[str, int], step: int) -> Failure:
        out = sorted(h for h, c in failed.items() if c == HostsLeftOut.LEFT_OUT_EXIT)
        return Failure("excluded", out[0] if out else None, step, None,
                       f"the job re-planned without slow host(s) {', '.join(out) or '?'}",
                       HostsLeftOut.LEFT_OUT_EXIT, hosts=tuple(out))

    def _died(self, failed: dict[str, int], beats: dict[str, heartbeat.Beat],
              step: int) -> Failure:
        """The failure behind these exits. A process killed by a signal or failing on its
        own is the culprit; processes that gave up waiting (a step past its deadline: HUNG_EXIT) are
        victims, and the culprit is then the one whose heartbeat froze."""
        culprits = {h: c for h, c in failed.items() if c != HUNG_EXIT}
        if not culprits:
            hung = self._hung(beats, step, 0.0)
            gave_up = ", ".join(sorted(failed))
            hung.detail = (f"{gave_up} gave up waiting at step {step}; frozen: "
                           f"{hung.host or 'none found'}")
            return hung
        host = min(culprits, key=lambda h: (culprits[h] >= 0, h))  # a signal first
        return Failure("died", host, step, self._since_fault(host),
                       f"process {host} exited with {_exit_text(culprits[host])}",
                       culprits[host])

    def _hung(self, beats: dict[str, heartbeat.Beat], step: int, limit: float) -> Failure:
        now = time.time()
        stale = sorted(h for h, b in beats.items() if now - b.time > self.config.stale_s)
        host = stale[0] if len(stale) == 1 else None
        return Failure("hung", host, step, self._since_fault(host) if host else None,
                       f"no progress for {limit:.1f} s after step {step}; "
                       f"frozen: {stale or 'none'}")

    def _since_fault(self, host: str | None) -> float | None:
        at = self._fault_time.pop(host, None) if host else None
        return None if at is None else self.clock() - at

    # ---- the job -------------------------------------------------------------------------
    def run(self) -> Summary:
        destinations = _launch_destinations(self.config.metrics)
        if destinations:
            self.metrics = Metrics(destinations, name="launch", signal_profile=False,
                                   say=lambda line: print(line, file=self.out, flush=True))
        self._close_gates()
        try:
            return self._run()
        finally:
            if self.metrics is not None:
                self.metrics.close()
            self._drop_standby()
            shutil.rmtree(self.config.checkpoint_dir / "standby", ignore_errors=True)
            shutil.rmtree(self._gates_dir(), ignore_errors=True)

    def _run(self) -> Summary:
        cfg = self.config
        hosts = [f"p{i}" for i in range(cfg.procs)]
        lost_from: int | None = None  # the job's step when the last failure was seen
        while True:
            record = self._record = health_record.load(cfg.checkpoint_dir)
            live = record.usable(hosts)
            if not live:
                raise ConfigError("every process of the job has been excluded; see "
                                  f"{health_record.path_in(cfg.checkpoint_dir)}")
            beat_dir = cfg.checkpoint_dir / "heartbeat" / f"incarnation{self._incarnation}"
            procs = self._relaunch(live, beat_dir)
            if self._incarnation == 0:  # no relaunch to slow down: prepare the next one now
                self._start_standby(len(procs))
            first = self._first_beat(procs, beat_dir)
            self.summary.restored.append(first)
            if lost_from is not None:
                self._steps_lost = max(0, lost_from - first)
                self.summary.steps_lost += self._steps_lost
            self._first_progress_at: float | None = None
            failure, step, beats = self._watch(procs, beat_dir, first)
            detected_at = self.clock() if failure is not None else None
            self._end(procs, failure, beats)
            if failure is not None:
                failure.end_s = self.clock() - detected_at
            self._record_incarnation(beats)
            if self.summary.restarts and self._first_progress_at is not None:
                self.summary.recovery_s.append(self._first_progress_at - self._last_detected)
            if failure is None:
                self.summary.final_step = step
                return self.summary
            self._last_detected = detected_at
            self._failed(failure, step)
            lost_from = step
    def _first_beat(self, procs: dict[str, subprocess.Popen], beat_dir: Path) -> int:
        """The step this incarnation restored from (its processes' first beats)."""
        deadline = self.clock() + self.config.startup_s
        while self.clock() < deadline:
            beats = heartbeat.read(beat_dir)
            if beats or any(p.poll() is not None for p in procs.values()):
                return min((b.step for b in beats.values()), default=0)
            time.sleep(self.config.poll_s)
        return 0

    def _record_incarnation(self, beats: dict[str, heartbeat.Beat]) -> None:
        plan = next((b.plan for h, b in sorted(beats.items()) if b.plan), "")
        if plan:
            self.summary.plans.append(plan)
        self.summary.sources.append(next((b.source for b in beats.values() if b.source), "?"))
        phases = next((b.phases for b in beats.values() if b.phases), None)
        if self.summary.restarts and phases:
            self.summary.phases.append(phases)

    def _failed(self, failure: Failure, step: int) -> None:
        cfg, summary = self.config, self.summary
        # read again: the job's process 0 may have noted slowdowns since the start
        record = health_record.load(cfg.checkpoint_dir)
        print(f"launch: {failure.kind}: {failure.detail}", file=self.out)
        summary.failures.append(failure)
        if failure.exit_code == USER_ERROR:  # a restart cannot fix a refused argument
            raise ConfigError(f"process {failure.host} refused its arguments; see "
                              f"{cfg.checkpoint_dir / 'logs'}")
        if failure.detect_s is not None:
            summary.detect_s.append(failure.detect_s)
        self._readmit(record, step)
        for host in failure.excluded():
            record.exclude(host, failure.detail, step)
        record.incarnations += 1
        health_record.save(record, cfg.checkpoint_dir)
        summary.restarts += 1
        if summary.restarts > cfg.max_restarts:
            times = "once" if summary.restarts == 1 else f"{summary.restarts} times"
            raise ConfigError(f"the job failed {times} (--max-restarts={cfg.max_restarts}); "
                              f"last: {failure.detail}")
        self._incarnation += 1

    def _readmission_due(self, step: int) -> bool:
        after = self.config.readmit_after_steps
        return after is not None and any(step - e.step >= after
                                         for e in self._record.excluded.values())

    def _readmit(self, record: health_record.HealthRecord, step: int) -> None:
        """Hosts excluded long enough ago come back, as repaired nodes rejoin a cluster."""
        after = self.config.readmit_after_steps
        if after is None:
            return
        for host, exclusion in list(record.excluded.items()):
            if step - exclusion.step >= after:
                del record.excluded[host]
                print(f"launch: host {host} readmitted (excluded at step {exclusion.step})",
                      file=self.out)

    def _lift(self, fault: Fault) -> None:
        throttle = self._throttles.pop(fault)
        throttle.stop()
        self.summary.throttled.append({"fault": fault.describe(), "mode": throttle.mode,
                                       "busy_s": round(throttle.busy_s, 3),
                                       "stopped_s": round(throttle.stopped_s, 3)})

    def _end(self, procs: dict[str, subprocess.Popen], failure: Failure | None,
             beats: dict[str, heartbeat.Beat]) -> None:
        """End every process. After a failure the others get SIGTERM first and up to
        `grace_s` to write their copies of the last step; a frozen process cannot (it is
        killed), nor can one still running after the grace period."""
        for fault in list(self._throttles):
            self._lift(fault)  # lets a throttled process run (and write) again
        running = [(h, p) for h, p in procs.items() if p.poll() is None]
        if failure is not None:
            # the others exit 75 naming the failure, not 74 as for a preemption (host_copies)
            self._peer_lost_file().write_text(f"{failure.kind}: {failure.detail}\n")
            now = time.time()
            # frozen: a hang's evidence is a stale heartbeat; after any other failure a stale
            # one may only be a survivor starved of CPU while it writes its copy (a loaded
            # host), so only a process that is stopped loses its grace period
            frozen = {h for h, b in beats.items() if now - b.time > self.config.stale_s and
                      (failure.kind == "hung" or h in procs and _stopped(procs[h].pid))}
            if failure.kind == "hung" and failure.host is not None:
                frozen.add(failure.host)
            for host, proc in running:
                standby.signal_group(proc.pid, signal.SIGKILL if host in frozen else signal.SIGTERM)
            deadline = self.clock() + self.config.grace_s
            while self.clock() < deadline and any(p.poll() is None for _, p in running):
                time.sleep(self.config.poll_s)
        for _, proc in running:
            if proc.poll() is None:
                standby.signal_group(proc.pid, signal.SIGKILL)  # also ends a stopped process
        for proc in procs.values():
            proc.wait()
        self._peer_lost_file().unlink(missing_ok=True)  # the next incarnation starts clean
        if self._service is not None:
            self._service.shutdown()
            self._service = None


def _finished_by_all(beats: dict[str, heartbeat.Beat], procs: dict[str, subprocess.Popen],
                     start_step: int) -> int:
    """The last step every running process has finished (and kept for the survivors' copies:
    a process beats only after that). Faults fire on it: a kill as soon as the fastest
    process reports the step could catch a slower peer inside that step's collectives, and
    the step would be lost with it."""
    return min((beats[h].step if h in beats else start_step for h in procs), default=start_step)


def _stopped(pid: int, proc: Path = Path("/proc")) -> bool:
    """Whether process `pid` is stopped (SIGSTOP: state T in /proc/PID/stat); False where it
    cannot be read (no /proc, or the process is gone)."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:][:1] in ("T", "t")


def _exit_text(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    meaning = EXIT_CODES.get(code)
    return f"code {code}" + (f" ({meaning})" if meaning else "")
