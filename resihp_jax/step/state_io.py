"""How orbax writes and reads a training state: each shard by the one device that holds its
first replica, with no slicing of replicated shards.

Orbax's default (`use_replica_parallel`, on except where `JAX_PLATFORMS` names a GPU) splits
a shard several devices hold into one slice per replica, each an eager `lax.slice` compiled
once per shape, sharding and offset: the first save under each plan compiles a program per
slice (`benchmarks/checkpoint_save.py`: 32 for `small` on dp=2,pp=2,tp=2, and 4.4x the time
of the save without them). A shard is written once either way, the writes still spread over
the hosts that hold the shards, and the files are orbax's standard PyTree layout.

orbax's `enable_pinned_host_transfer` stays at its platform default: on GPUs the save's
device-to-host copy goes through `pinned_host` memory (a DMA beside the step's kernels).
"""

from __future__ import annotations

from typing import Any

import jax


def state_handler() -> Any:
    """A PyTree checkpoint handler whose arrays are written without replica slicing."""
    import orbax.checkpoint as ocp  # noqa: PLC0415 - loop users without checkpoints skip it

    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def save_args(tree: Any) -> Any:
    """The orbax arguments that save `tree` (a pytree of jax.Arrays) with `state_handler`."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    return ocp.args.PyTreeSave(tree)


def restore_args(target: Any) -> Any:
    """The orbax arguments that read a saved tree into `target` (ShapeDtypeStructs with
    shardings) with `state_handler`."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    return ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
