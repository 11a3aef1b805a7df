"""The cross-replica engine on torchft: a Manager per process, a Lighthouse per job.

torchft (Meta's engine for FT-HSDP) gives the quorum (its Lighthouse), the reconfigurable
process group (Gloo on CPU, NCCL on GPU) and the heal from a live peer (its HTTP transport).
Arrays cross into torch by DLPack, without a copy, and back the same way.

torch and torchft are an extra: `pip install "resihp_jax[ft]"`. A run of one replica never
imports either.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import numpy as np

from resihp_jax.errors import ConfigError
from resihp_jax.runtime.replicas.engine import HostState, Quorum, StateFns
from resihp_jax.runtime.replicas.split import majority

QUORUM_RETRIES = 50
INSTALL = 'pip install "resihp_jax[ft]"  (torch==2.13.0 and torchft==0.2.0)'


def _modules() -> tuple[Any, Any]:
    try:
        torch = importlib.import_module("torch")
        torchft = importlib.import_module("torchft")
    except ImportError as err:
        raise ConfigError(f"replicas need torch and torchft ({err.name} is missing): "
                          f"{INSTALL}") from None
    return torch, torchft


def check_installed() -> None:
    """ConfigError naming the install command where torch or torchft is missing (without
    importing either: the launcher only starts processes)."""
    missing = [m for m in ("torch", "torchft") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"--replicas needs {' and '.join(missing)}: {INSTALL}")


@dataclass(frozen=True)
class Timeouts:
    """One ladder, shortest first (seconds): a collective with a dead or hung peer gives up
    before the Lighthouse stops counting the peer (heartbeat), which is before a joining
    replica is waited for (join), which is before a quorum is given up (quorum)."""
    # a kill costs the survivors about the heartbeat timeout (the quorum waits for the dead
    # replica's heartbeats to stop): 3.25 s between two steps at 2 / 3 s on 2 CPU cores
    # (tiny, 3 replicas). Not yet derived from the measured step and heal times
    collective_s: float = 1.0
    heartbeat_s: float = 1.5
    join_s: float = 10.0
    quorum_s: float = 60.0

    def __post_init__(self) -> None:
        ladder = (self.collective_s, self.heartbeat_s, self.join_s, self.quorum_s)
        if not 0 < ladder[0] < ladder[1] < ladder[2] < ladder[3]:
            raise ConfigError(f"replica timeouts {ladder}: need 0 < collective_s < "
                              "heartbeat_s < join_s < quorum_s")


class TorchftEngine:
    """`ReplicaEngine` on a torchft Manager (one per process of a replica)."""

    def __init__(self, *, replica: int, n_replicas: int, group_rank: int, group_size: int,
                 lighthouse: str, store_host: str, store_port: int, state: StateFns,
                 timeouts: Timeouts | None = None, gpu: bool = False) -> None:
        torch, torchft = _modules()
        timeouts = timeouts or Timeouts()
        self._torch = torch
        save_state, load_state = state
        timeout = timedelta(seconds=timeouts.collective_s)
        pg = (torchft.ProcessGroupNCCL(timeout=timeout) if gpu
              else torchft.ProcessGroupGloo(timeout=timeout))
        self._manager = torchft.Manager(
            pg=pg,
            # torchft hands torch tensors both ways; ours are host arrays
            state_dict=lambda: {k: torch.from_numpy(np.ascontiguousarray(v))
                                for k, v in save_state().items()},
            load_state_dict=lambda d: load_state({k: v.numpy() for k, v in d.items()}),
            min_replica_size=majority(n_replicas),
            use_async_quorum=False,  # heal before the step's gradients, not during them
            timeout=timeout,
            quorum_timeout=timedelta(seconds=timeouts.quorum_s),
            connect_timeout=timedelta(seconds=timeouts.join_s),
            rank=group_rank, world_size=group_size,
            store_addr=store_host, store_port=store_port,
            lighthouse_addr=lighthouse, replica_id=f"replica_{replica}",
            # every replica starts from the same seeded state; a late one is behind in step
            # and heals anyway
            init_sync=False,
            # the Manager asks the Lighthouse again after a broken request (its restart)
            quorum_retries=QUORUM_RETRIES)
        self._last: Quorum | None = None
        self._n_replicas = n_replicas
        self._timeouts = timeouts

    @property
    def step(self) -> int:
        """Committed steps (the quorum's newest after a heal)."""
        return int(self._manager.current_step())

    def start_step(self) -> Quorum:
        before = self.step
        self._quorum_with_retries()
        rank = self._manager.participating_rank()
        quorum = Quorum(quorum_id=int(self._manager._quorum_id),
                        rank=-1 if rank is None else int(rank),
                        live=int(self._manager.num_participants()), step=self.step,
                        healed=self.step != before)
        self._last = quorum
        return quorum

    def _quorum_with_retries(self) -> None:
        """The step's quorum; one the Lighthouse's restart broke (its connection reset, a
        TimeoutError) is asked again until the quorum timeout: the replicas keep their state
        and step, and the restarted Lighthouse forms a new quorum from their requests."""
        deadline = time.monotonic() + self._timeouts.quorum_s
        while True:
            try:
                self._manager.start_quorum()
                return
            except Exception:  # noqa: BLE001  (torchft raises its transport's errors as-is)
                if time.monotonic() > deadline:
                    raise
                # the failed request stays the Manager's pending quorum and would be raised
                # again by the next start_quorum: forget it
                self._manager._quorum_future = None
                time.sleep(0.1)

    def sum_pieces(self, pieces: Sequence[Any]) -> list[np.ndarray]:
        """Sums over the quorum, by dtype in one flat buffer each (one collective per dtype)."""
        torch = self._torch
        hosts = [np.asarray(p) for p in pieces]
        out: list[np.ndarray | None] = [None] * len(hosts)
        for dtype in sorted({h.dtype.str for h in hosts}):
            idx = [i for i, h in enumerate(hosts) if h.dtype.str == dtype]
            flat = np.concatenate([hosts[i].reshape(-1) for i in idx])
            tensor = torch.from_numpy(flat)  # shares `flat`'s memory: summed in place
            work = self._manager.allreduce(tensor, reduce_op=torch.distributed.ReduceOp.SUM)
            work.wait()
            offset = 0
            for i in idx:
                n = hosts[i].size
                out[i] = flat[offset:offset + n].reshape(hosts[i].shape)
                offset += n
        return out  # type: ignore[return-value]

    def commit(self) -> bool:
        """Whether the step counts. Step 0 counts only with every replica in its quorum (the
        start-up barrier): replicas that start apart would otherwise train step 0 in two
        quorums and stay different, which torchft cannot see ("same step, same state")."""
        last = self._last
        if last is not None and last.step == 0 and last.live < self._n_replicas:
            self._manager.report_error(RuntimeError("start-up barrier: not every replica "
                                                    "has joined step 0"))
        return bool(self._manager.should_commit())

    def close(self) -> None:
        self._manager.shutdown(wait=False)


def lighthouse(n_replicas: int, *, bind: str = "[::]:0", timeouts: Timeouts | None = None,
               tick_ms: int = 50) -> Any:
    """A Lighthouse for a job of `n_replicas`: quorums take a majority."""
    _modules()
    timeouts = timeouts or Timeouts()
    from torchft._torchft import LighthouseServer  # noqa: PLC0415  (the extra's own module)
    return LighthouseServer(bind=bind, min_replicas=majority(n_replicas),
                            join_timeout_ms=int(timeouts.join_s * 1000),
                            quorum_tick_ms=tick_ms,
                            heartbeat_timeout_ms=int(timeouts.heartbeat_s * 1000))


def host_state_size(state: HostState) -> int:
    return int(sum(v.nbytes for v in state.values()))


def store_server(host: str, port: int) -> Any:
    """The replica's key-value store (torch's TCPStore), which its Managers meet at."""
    torch, _ = _modules()
    return torch.distributed.TCPStore(host, port, is_master=True, wait_for_workers=False)
