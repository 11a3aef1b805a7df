"""`resihp launch --replicas R`: a job of R replicas, each supervised on its own.

The N processes are split into R equal groups of consecutive processes; each group is a
replica: a JAX job of its own (its own coordination service, `jax.distributed` world and
mesh) under a `Supervisor` of its own, which ends and relaunches that replica alone when one
of its processes dies or hangs (the whole replica, on the same number of processes, so its
mesh stays its peers'). The other replicas' processes are never restarted: they train on with
the smaller quorum, and the relaunched replica heals from a live peer when it joins.

The job's Lighthouse (torchft's quorum server) runs beside them and is restarted on its port
if it dies; the replicas keep their state across its restart.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

from resihp_jax.env_vars import LIGHTHOUSE_ENV, REPLICA_ENV, REPLICA_STORE_ENV, REPLICAS_ENV
from resihp_jax.errors import ConfigError
from resihp_jax.faults.processes import Fault
from resihp_jax.runtime.job.launch_types import LaunchConfig, Summary
from resihp_jax.runtime.job.supervisor import Supervisor, free_port
from resihp_jax.runtime.replicas.lighthouse import LighthouseProcess
from resihp_jax.runtime.replicas.split import check_replicas


@dataclass
class ReplicaSummary:
    """The job's account: each replica's own, and the Lighthouse's restarts."""
    replicas: list[Summary]
    lighthouse_restarts: int = 0
    errors: dict[int, str] = field(default_factory=dict)  # replica -> why it gave up

    def to_json(self) -> dict:
        return {"replicas": [s.to_json() for s in self.replicas],
                "replica_restarts": [s.restarts for s in self.replicas],
                "lighthouse_restarts": self.lighthouse_restarts,
                "errors": {str(k): v for k, v in self.errors.items()}}


def split_faults(faults: tuple[Fault, ...], n_replicas: int, per_replica: int
                 ) -> list[tuple[Fault, ...]]:
    """Each fault on process P given to P's replica, as that replica's process P % n."""
    out: list[list[Fault]] = [[] for _ in range(n_replicas)]
    for fault in faults:
        if fault.by_rank:
            raise ConfigError(f"{fault.describe()}: a job of replicas takes faults by process")
        out[fault.process // per_replica].append(
            dataclasses.replace(fault, process=fault.process % per_replica))
    return [tuple(f) for f in out]


def replica_configs(config: LaunchConfig, n_replicas: int, lighthouse: str
                    ) -> list[LaunchConfig]:
    """One launch of `config.procs / n_replicas` processes per replica, in a directory each."""
    check_replicas(config.procs, n_replicas)
    per = config.procs // n_replicas
    faults = split_faults(config.faults, n_replicas, per)
    return [dataclasses.replace(
        config, procs=per, checkpoint_dir=config.checkpoint_dir / f"replica{r}",
        faults=faults[r], standby=False, replace_failed=True,
        # a replica's survivors need not write copies: its peers hold the state
        grace_s=min(config.grace_s, 5.0),
        extra_env=(*config.extra_env, (REPLICA_ENV, str(r)), (REPLICAS_ENV, str(n_replicas)),
                   (LIGHTHOUSE_ENV, lighthouse),
                   (REPLICA_STORE_ENV, f"127.0.0.1:{free_port()}")))
        for r in range(n_replicas)]


class ReplicaJob:
    def __init__(self, config: LaunchConfig, n_replicas: int, out: TextIO = sys.stderr,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.n_replicas, self.out, self.clock = config, n_replicas, out, clock
        config.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.lighthouse = LighthouseProcess(n_replicas, free_port(),
                                            config.checkpoint_dir / "lighthouse.log")
        self.configs = replica_configs(config, n_replicas, self.lighthouse.address)
        # the job's faults land one at a time: each once every replica trains (a fault due
        # while a replica is still down waits, the processes going on meanwhile)
        self.supervisors = [Supervisor(c, out=out, clock=clock, fault_hold=self._one_down)
                            for c in self.configs]
        self._finished = threading.Event()  # a replica trained the whole run

    def run(self) -> ReplicaSummary:
        summary = ReplicaSummary([s.summary for s in self.supervisors])
        self.lighthouse.start()
        threads = [threading.Thread(target=self._supervise, args=(r, summary),
                                    name=f"replica{r}") for r in range(self.n_replicas)]
        try:
            for thread in threads:
                thread.start()
            while any(t.is_alive() for t in threads):
                if self._finished.is_set():  # the run is trained: a replica behind cannot
                    for supervisor in self.supervisors:  # catch up alone
                        supervisor.stop()
                if not self.lighthouse.alive():
                    print("launch: the Lighthouse died: restarting it on its port",
                          file=self.out, flush=True)
                    self.lighthouse.restart()
                    summary.lighthouse_restarts += 1
                time.sleep(self.config.poll_s)
        finally:
            for thread in threads:
                thread.join()
            self.lighthouse.stop()
        return summary

    def _one_down(self) -> bool:
        return not all(s.training for s in self.supervisors)

    def _supervise(self, replica: int, summary: ReplicaSummary) -> None:
        try:
            self.supervisors[replica].run()
            self._finished.set()
        except ConfigError as err:  # it gave up; the others go on with a smaller quorum
            summary.errors[replica] = str(err)
            print(f"launch: replica {replica} gave up: {err}", file=self.out, flush=True)
