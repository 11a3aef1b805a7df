"""The local supervisor behind `resihp launch`: start N processes of one multi-controller
job, watch them, and do for a local job what a cluster's restart policy does for a real one
(docs/DESIGN.md, "The job: relaunch and the warm standby").

An exit is seen at the next poll; a hang when the job's step has not advanced within the
deadline its processes publish, the culprit being the process whose heartbeat went stale
(blame.py). Either way every process is ended, the culprit's host excluded in the health
record, and the job relaunched on the survivors: the warm standby (standby.py) when it fits,
else fresh processes. Each process gets its devices from the supervisor's environment, never
from a JAX backend of its own (accelerators.py). Test faults are `ProcessFaults`'
(faults/processes.py); time is injected (`clock`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, TextIO

from resihp_jax.env_vars import (CHECKPOINT_DIR_ENV, EXTERNAL_SERVICE_ENV, HEARTBEAT_DIR_ENV,
                                 JOB_SPEC_ENV, METRICS_ENV, PEER_LOST_ENV, REPLICA_ENV,
                                 REPLICA_REJOIN_ENV)
from resihp_jax.errors import ConfigError
from resihp_jax.faults.processes import ProcessFaults, signal_group
from resihp_jax.metrics import Destination, Metrics, parse_destinations
from resihp_jax.metrics.destinations import for_replica
from resihp_jax.metrics.entry import relaunch_entry
from resihp_jax.runtime.job import distributed, heartbeat
from resihp_jax.runtime.job.blame import PLANNED_EXITS, Blame
from resihp_jax.runtime.job.exits import USER_ERROR
from resihp_jax.runtime.job.launch_types import Failure, LaunchConfig, Summary
from resihp_jax.runtime.job.standby import StandbyKeeper
from resihp_jax.runtime.recovery import health_record


def _launch_destinations(metrics: tuple[str, ...], env: dict[str, str]
                         ) -> tuple[Destination, ...]:
    """Where the supervisor writes its relaunches: a TensorBoard directory's `launch` run
    (beside the job's, never in the same files; a replica's beside its own), W&B runs named
    `launch`; JSON lines files hold steps only."""
    return tuple(Destination("tensorboard", str(Path(d.target) / "launch"))
                 if d.kind == "tensorboard" else d
                 for d in for_replica(parse_destinations(metrics, "--metrics"), env)
                 if d.kind in ("tensorboard", "wandb"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Supervisor:
    def __init__(self, config: LaunchConfig, out: TextIO = sys.stderr,
                 clock: Callable[[], float] = time.monotonic,
                 fault_hold: Callable[[], bool] | None = None) -> None:
        """`fault_hold`: kills and hangs wait while it says so, without holding the processes
        at the fault's step (a job of replicas: a fault lands once every replica trains)."""
        self.config, self.out, self.clock = config, out, clock
        self.summary = Summary()
        self._last_detected = 0.0  # when the last failure was detected
        self._record = health_record.HealthRecord()  # as the running incarnation read it
        self._service = None  # the running incarnation's coordination service
        self._incarnation = 0
        self._steps_lost = 0  # by the last relaunch
        self.metrics: Metrics | None = None  # where relaunches go (LaunchConfig.metrics)
        self.standby = StandbyKeeper(config.checkpoint_dir, self._start, self._log,
                                     enabled=config.keeps_standby, out=out, clock=clock,
                                     waits_s=self.summary.standby_waits_s)
        # a kill or hang due at a step waits until the standby is ready (faults_wait_for_standby)
        wait = config.faults_wait_for_standby and config.keeps_standby
        self.faults = ProcessFaults(config.faults, config.checkpoint_dir / "fault_gates",
                                    out=out, clock=clock,
                                    hold=fault_hold or ((lambda: not self.standby.ready())
                                                        if wait else None),
                                    hold_at_gate=fault_hold is None,
                                    injected=self.summary.injected,
                                    throttled=self.summary.throttled)
        self.blame = Blame(config.stale_s, self.faults.since)
        self._stop = threading.Event()  # `stop`: end the job's processes, no relaunch
        self.training = False  # the running incarnation has trained a step

    def stop(self) -> None:
        """End this job at the next poll, as finished (a job of replicas whose peers finished
        the run: this replica cannot train alone)."""
        self._stop.set()

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
        env = dict(os.environ, **{HEARTBEAT_DIR_ENV: str(beat_dir), EXTERNAL_SERVICE_ENV: "1",
                                  PEER_LOST_ENV: str(self._peer_lost_file())},
                   **self.faults.env(), **dict(cfg.extra_env), **(extra_env or {}))
        if cfg.metrics:
            env[METRICS_ENV] = "\n".join(cfg.metrics)
        if self._incarnation and REPLICA_ENV in env:  # its records before the heal stay
            env[REPLICA_REJOIN_ENV] = "1"
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

    def _relaunch(self, live: list[str], beat_dir: Path) -> dict[str, subprocess.Popen]:
        """The incarnation's processes: the standby promoted when it fits, else new ones."""
        held = self.standby.take(live, self._incarnation)
        if held is not None:
            self._service = held.service
            self.summary.relaunched_by.append("standby")
            rss = held.rss_mb()
            if rss is not None:
                self.summary.standby_rss_mb.append(rss)
            return held.promote(live)
        if self._incarnation > 0:
            self.summary.relaunched_by.append("fresh")
        return self._spawn(live, beat_dir)

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
        env = JOB_SPEC_ENV
        return list(cfg.command), {
            env["coordinator"]: coordinator, env["num_processes"]: str(n),
            env["process_id"]: str(index), env["host_id"]: host,
            CHECKPOINT_DIR_ENV: str(cfg.checkpoint_dir)}

    def _watch(self, procs: dict[str, subprocess.Popen], beat_dir: Path,
               start_step: int) -> tuple[Failure | None, int, dict[str, heartbeat.Beat]]:
        """Until every process exits 0 (None) or one fails; also the job's last step."""
        cfg = self.config
        step, advanced_at, started = start_step, self.clock(), False
        self.training = False
        beats: dict[str, heartbeat.Beat] = {}
        while True:
            time.sleep(cfg.poll_s)
            if self._stop.is_set():
                return None, step, beats
            exited = {h: p.returncode for h, p in procs.items() if p.poll() is not None}
            failed = {h: c for h, c in exited.items() if c != 0}
            beats = heartbeat.read(beat_dir)
            now_step = max((b.step for b in beats.values()), default=step)
            if now_step > step:
                if not started:
                    self._first_progress_at = self.clock()
                    self._relaunched(now_step)
                    self.standby.start(len(procs), self._incarnation + 1)
                step, advanced_at, started = now_step, self._advanced_at(beats, now_step), True
                self.training = True
            self.standby.check()
            if failed and set(failed.values()) <= PLANNED_EXITS:
                # a re-plan left processes out: all exit on their own, those left out with
                # their own code, once their copies are written
                if len(exited) < len(procs) and self.clock() - advanced_at < cfg.startup_s:
                    continue
                return self.blame.left_out(failed, step), step, beats
            if failed:
                failure = self.blame.died(failed, beats, step)
                if failure.kind == "hung":  # the processes' own deadlines caught it first
                    failure.stalled_s = self.clock() - advanced_at
                return failure, step, beats
            if len(exited) == len(procs):
                return None, step, beats
            finished = _finished_by_all(beats, procs, start_step)
            if self.faults.inject(procs, finished):
                # every process waits at the step's gate for a fault held back (a standby
                # not ready yet): the job is not stalled, it is held
                advanced_at = self.clock()
            if started and self._repaired(self._record, step):
                return Failure("readmit", None, step, None, "excluded host(s) repaired: "
                               "restarting to take them in"), step, beats
            # the deadline the processes publish for the step in flight (from the cost
            # model, with their floor); their own step deadlines use the same figure
            limit = cfg.startup_s if not started else \
                max((b.deadline_s for b in beats.values()), default=cfg.startup_s)
            if self.clock() - advanced_at > limit or self._frozen_while_waited_on(beats):
                hung = self.blame.hung(beats, step, min(limit, self.clock() - advanced_at))
                hung.stalled_s = self.clock() - advanced_at
                return hung, step, beats

    def _frozen_while_waited_on(self, beats: dict[str, heartbeat.Beat]) -> bool:
        """A process of a replica waits on its peers' quorum while another of its own
        processes is frozen (the quorum waits for that one: its replica never joins)."""
        if not any(b.waiting for b in beats.values()):
            return False
        now = time.time()
        return any(now - b.time > self.config.stale_s for b in beats.values())

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

    # ---- the job -------------------------------------------------------------------------
    def run(self) -> Summary:
        destinations = _launch_destinations(self.config.metrics, dict(self.config.extra_env))
        if destinations:
            self.metrics = Metrics(destinations, name="launch", signal_profile=False,
                                   say=lambda line: print(line, file=self.out, flush=True))
        self.faults.close_gates()
        try:
            return self._run()
        finally:
            if self.metrics is not None:
                self.metrics.close()
            self.standby.close()
            self.faults.remove_gates()

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
                self.standby.start(len(procs), self._incarnation + 1)
            first = self._first_beat(procs, beat_dir)
            self.summary.restored.append(first)
            if lost_from is not None:
                self._steps_lost = max(0, lost_from - first)
                self.summary.steps_lost += self._steps_lost
            self._first_progress_at: float | None = None
            failure, step, beats = self._watch(procs, beat_dir, first)
            self.training = False  # (until the next incarnation trains: a fault waits)
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
        for host in () if cfg.replace_failed else failure.excluded():
            record.exclude(host, failure.detail, step)
        record.incarnations += 1
        health_record.save(record, cfg.checkpoint_dir)
        summary.restarts += 1
        if summary.restarts > cfg.max_restarts:
            times = "once" if summary.restarts == 1 else f"{summary.restarts} times"
            raise ConfigError(f"the job failed {times} (--max-restarts={cfg.max_restarts}); "
                              f"last: {failure.detail}")
        self._incarnation += 1

    def _repaired(self, record: health_record.HealthRecord, step: int) -> list[str]:
        """Hosts excluded long enough ago to come back, as repaired nodes rejoin a cluster."""
        after = self.config.readmit_after_steps
        return [] if after is None else [h for h, e in record.excluded.items()
                                         if step - e.step >= after]

    def _readmit(self, record: health_record.HealthRecord, step: int) -> None:
        for host in self._repaired(record, step):
            exclusion = record.excluded.pop(host)
            print(f"launch: host {host} readmitted (excluded at step {exclusion.step})",
                  file=self.out)

    def _end(self, procs: dict[str, subprocess.Popen], failure: Failure | None,
             beats: dict[str, heartbeat.Beat]) -> None:
        """End every process. After a failure the others get SIGTERM first and up to
        `grace_s` to write their copies of the last step; a frozen process cannot (it is
        killed), nor can one still running after the grace period."""
        self.faults.lift_all()  # lets a throttled process run (and write) again
        running = [(h, p) for h, p in procs.items() if p.poll() is None]
        if failure is not None:
            # the others exit 75 naming the failure, not 74 as for a preemption (host_copies)
            self._peer_lost_file().write_text(f"{failure.kind}: {failure.detail}\n")
            frozen = self.blame.frozen(failure, beats, procs)
            for host, proc in running:
                signal_group(proc.pid, signal.SIGKILL if host in frozen else signal.SIGTERM)
            deadline = self.clock() + self.config.grace_s
            while self.clock() < deadline and any(p.poll() is None for _, p in running):
                time.sleep(self.config.poll_s)
        for _, proc in running:
            if proc.poll() is None:
                signal_group(proc.pid, signal.SIGKILL)  # also ends a stopped process
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
