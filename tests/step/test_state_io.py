"""The state's orbax handler writes replicated shards without compiling a slice per replica,
and reads what orbax's standard handler wrote (checkpoints from before it) into any sharding."""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from resihp_jax.runtime.programs import compiles
from resihp_jax.step.state_io import restore_args, save_args, state_handler


def _tree(mesh: Mesh) -> dict[str, jax.Array]:
    """Leaves replicated over every device, or over the second axis only (like dp)."""
    return {"replicated": jax.device_put(jnp.arange(48.0).reshape(6, 8), NamedSharding(mesh, P())),
            "half": jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("a"))),
            "step": jax.device_put(jnp.int32(7), NamedSharding(mesh, P()))}


def _compiles_while(fn) -> int:
    compiles.install()
    start = time.time()
    fn()
    return compiles.foreground_since(start)[0]


def test_a_replicated_state_is_saved_without_compiling(tmp_path: Path) -> None:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    tree = _tree(mesh)

    def save(handler: ocp.PyTreeCheckpointHandler, name: str) -> None:
        with ocp.Checkpointer(handler) as checkpointer:
            checkpointer.save(tmp_path / name, args=save_args(tree))

    assert _compiles_while(lambda: save(state_handler(), "ours")) == 0
    # the counter sees the slices orbax compiles when it splits replicated shards
    slicing = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=True)))
    assert _compiles_while(lambda: save(ocp.PyTreeCheckpointHandler(
        type_handler_registry=slicing), "slicing")) > 0


def test_what_the_standard_handler_wrote_reads_back_into_another_sharding(
        tmp_path: Path) -> None:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    tree = _tree(mesh)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "old", tree)
        checkpointer.wait_until_finished()
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, P(None, "b") if x.ndim else P())), tree)
    with ocp.Checkpointer(state_handler()) as checkpointer:
        restored = checkpointer.restore(tmp_path / "old", args=restore_args(target))
    for name, leaf in tree.items():
        np.testing.assert_array_equal(restored[name], leaf)
        assert restored[name].sharding == target[name].sharding
