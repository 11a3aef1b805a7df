"""Replica failure domains: data-parallel replicas that fail, heal and rejoin on their own.

A job of R replicas trains one global batch a step: each replica is a JAX job of its own
(its own `jax.distributed` world and mesh, the same in every replica), the live replicas of
each step's quorum split its micro-batches (`split.py`), and each process sums its gradient
shards with the same shards of the other replicas through a cross-replica engine
(`engine.py`; torchft's in `torchft_engine.py`).
"""
