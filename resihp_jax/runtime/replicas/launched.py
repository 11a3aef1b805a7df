"""A launched replica's place in its job, from the launcher's variables, and its engine."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from resihp_jax.env_vars import LIGHTHOUSE_ENV, REPLICA_ENV, REPLICA_STORE_ENV, REPLICAS_ENV
from resihp_jax.errors import ConfigError
from resihp_jax.runtime.replicas.engine import ReplicaEngine, StateFns


@dataclass(frozen=True)
class ReplicaPlace:
    replica: int
    n_replicas: int
    lighthouse: str  # http://HOST:PORT
    store: str  # HOST:PORT, served by the replica's process 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ReplicaPlace | None:
        """The place the launcher gave this process; None outside a job of replicas."""
        if REPLICA_ENV not in env:
            return None
        missing = [k for k in (REPLICAS_ENV, LIGHTHOUSE_ENV, REPLICA_STORE_ENV) if k not in env]
        if missing:
            raise ConfigError(f"{REPLICA_ENV} is set but {', '.join(missing)} not: a replica "
                              "needs all four (resihp launch --replicas sets them)")
        try:
            replica, n = int(env[REPLICA_ENV]), int(env[REPLICAS_ENV])
        except ValueError:
            raise ConfigError(f"{REPLICA_ENV}={env[REPLICA_ENV]!r} and {REPLICAS_ENV}="
                              f"{env[REPLICAS_ENV]!r}: both must be integers") from None
        if not 0 <= replica < n:
            raise ConfigError(f"{REPLICA_ENV}={replica}: valid are 0..{n - 1}")
        return cls(replica, n, env[LIGHTHOUSE_ENV], env[REPLICA_STORE_ENV])


def launched_engine(place: ReplicaPlace, group_rank: int, group_size: int,
                    state: StateFns) -> tuple[ReplicaEngine, Any]:
    """This process's engine, and the replica's store where this process serves it (keep
    it alive as long as the engine)."""
    from resihp_jax.runtime.replicas.torchft_engine import TorchftEngine, store_server  # noqa: PLC0415

    host, port = place.store.rsplit(":", 1)
    store = store_server(host, int(port)) if group_rank == 0 else None
    engine = TorchftEngine(replica=place.replica, n_replicas=place.n_replicas,
                           group_rank=group_rank, group_size=group_size,
                           lighthouse=place.lighthouse, store_host=host, store_port=int(port),
                           state=state)
    return engine, store


def replicas_in_job(env: Mapping[str, str] = os.environ) -> int:
    """How many replicas share each step's global batch (1 outside a job of replicas)."""
    place = ReplicaPlace.from_env(env)
    return 1 if place is None else place.n_replicas


def launched_link(place: ReplicaPlace, microbatches_per_replica: int, dp_in: int) -> Any:
    """The trainer's collaborator for this process of a launched replica (its engine made
    once the link can hand it the state a peer's heal asks for)."""
    import jax  # noqa: PLC0415

    from resihp_jax.runtime.replicas.link import ReplicaLink  # noqa: PLC0415

    kept: list[Any] = []

    def engine(state: StateFns) -> ReplicaEngine:
        made, store = launched_engine(place, jax.process_index(), jax.process_count(), state)
        kept.append(store)  # served as long as the engine runs
        return made

    # (`engine` holds `kept`, and the link holds `engine`: the store lives as long as the link)
    return ReplicaLink(engine, place.n_replicas, microbatches_per_replica, dp_in)
