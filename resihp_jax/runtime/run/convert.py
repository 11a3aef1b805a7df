"""A checkpoint of the retired built-in decoder converted into the one step's state.

The decoder's canonical state was `{embed, layers, head}`, `rh.models.Llama`'s is `{shell,
blocks}`: the same arrays (layers stacked `[n_layers, ...]` alike), so a checkpoint converts
by renaming its leaves, in the parameters and in every optimizer statistic that mirrors them.
Its optimizer was the presets' AdamW with the learning rate scheduled, not injected: Adam's
statistics and counts go as written into the injected optimizer's state, its
hyper-parameters those of the last update the checkpoint made. Step, data position and plan
carry over, and the checkpoint gains the preset run's identity, so `resihp train --resume`
continues exactly where it stopped. Every array is read onto the host: a machine with host
memory for one copy of the state runs it (`tools/convert_decoder_checkpoint.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from resihp_jax.errors import CheckpointError
from resihp_jax.models.config import ModelConfig
from resihp_jax.models.optimizer import AdamWConfig
from resihp_jax.runtime.recovery.checksum import leaf_shapes, state_checksums
from resihp_jax.runtime.recovery.run_identity import retired_layout
from resihp_jax.runtime.run.model_identity import path_names
from resihp_jax.runtime.run.programs import preset_programs
from resihp_jax.step.program import TrainState

# the built-in decoder's name of each block leaf -> its path in rh.models.Llama's blocks
_BLOCK_PATHS = {"attn_norm": ("attn_norm", "scale"), "wq": ("wq",), "wk": ("wk",),
                "wv": ("wv",), "wo": ("wo",), "mlp_norm": ("mlp_norm", "scale"),
                "w_gate": ("w_gate",), "w_up": ("w_up",), "w_down": ("w_down",)}
_SHELL_PATHS = {("embed", "table"): ("shell", "table"),
                ("head", "norm"): ("shell", "final_norm", "scale"),
                ("head", "w"): ("shell", "lm_head")}


def new_path(old: tuple[str, ...]) -> tuple[str, ...]:
    """The path in the one step's state of the decoder's leaf at `old` (a parameter, or an
    optimizer statistic of one: the layout sits anywhere in the path); others unchanged."""
    for i in range(len(old) - 1):
        pair = old[i:i + 2]
        if pair in _SHELL_PATHS:
            return old[:i] + _SHELL_PATHS[pair] + old[i + 2:]
        if pair[0] == "layers" and pair[1] in _BLOCK_PATHS:
            return old[:i] + ("blocks", *_BLOCK_PATHS[pair[1]]) + old[i + 2:]
    return old


def retired_optimizer(adamw: AdamWConfig) -> optax.GradientTransformation:
    """The decoder's optimizer: `adamw`'s, its learning rate scheduled rather than injected
    (its state's tree is `(clip, (adam, decay, schedule))`)."""
    return optax.chain(optax.clip_by_global_norm(adamw.grad_clip),
                       optax.adamw(adamw.schedule(), b1=adamw.b1, b2=adamw.b2,
                                   weight_decay=adamw.weight_decay))


def injected_state(retired: TrainState, optimizer: optax.GradientTransformation) -> TrainState:
    """`retired` (under `retired_optimizer`) as the state of `optimizer`, the presets'
    `(clip, inject_hyperparams(adamw))`: Adam's statistics as written; the injected counts
    the schedule's, and the hyper-parameters of the last update it made (those updates
    replayed on no parameters: the counts and hyper-parameters alone)."""
    clip, (adam, _, schedule) = retired.opt_state
    count = int(schedule.count)
    counts = jax.jit(optimizer.init)({})
    if count > 0:
        before = jax.tree.map(lambda x: jnp.full_like(x, count - 1) if x.ndim == 0 and
                              jnp.issubdtype(x.dtype, jnp.integer) else x, counts)
        counts = jax.jit(optimizer.update)({}, before, {})[1]
    inject = jax.device_get(counts[1])
    inject = inject._replace(inner_state=(adam, *inject.inner_state[1:]))
    return TrainState(retired.step, retired.params, (clip, inject))


def converted_state(raw: Any, target: TrainState, where: str) -> TrainState:
    """The decoder's raw state (nested dicts and lists of host arrays) as `target`'s tree."""
    old = {new_path(path_names(p)): leaf
           for p, leaf in jax.tree_util.tree_flatten_with_path(raw)[0]}
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    leaves = []
    for path, shape in flat:
        names = path_names(path)
        leaf = old.pop(names, None)
        if leaf is None or tuple(leaf.shape) != tuple(shape.shape):
            found = "missing" if leaf is None else f"shape {tuple(leaf.shape)}"
            raise CheckpointError(f"{where}: leaf {'/'.join(names)} is {found}; "
                                  f"rh.models.Llama needs shape {tuple(shape.shape)}")
        leaves.append(np.asarray(leaf, dtype=shape.dtype))
    if old:
        raise CheckpointError(f"{where}: leaves rh.models.Llama has no place for: "
                              f"{', '.join('/'.join(p) for p in sorted(old)[:4])}")
    return jax.tree_util.tree_unflatten(treedef, leaves)


def convert_checkpoint(source: Path, destination: Path, step: int | None = None,
                       say: Callable[[str], None] = print) -> int:
    """Write the decoder's checkpoint at `step` (default: the newest) of `source` as a
    checkpoint of `rh.models.Llama`'s state in `destination` (new or empty); returns the
    step. Refuses, naming the directory, anything but a decoder's checkpoint."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    from resihp_jax.step.state_io import save_args, state_handler  # noqa: PLC0415

    if not source.is_dir():
        raise CheckpointError(f"{source}: no such checkpoint directory")
    if destination.exists() and any(destination.iterdir()):
        raise CheckpointError(f"{destination}: not empty; give a new or empty directory")
    handlers = {"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(source.absolute(), item_handlers=handlers) as reader:
        steps = reader.all_steps()
        if not steps or (step is not None and step not in steps):
            which = "" if step is None else f" step {step}"
            raise CheckpointError(f"{source}: no checkpoint{which} (steps found: "
                                  f"{sorted(steps) or 'none'})")
        step = max(steps) if step is None else step
        where = f"checkpoint step {step} in {source}"
        meta = reader.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        identity = _decoder_identity(meta, where)
        shapes = reader.item_metadata(step)["state"]
        shapes = getattr(shapes, "tree", shapes)
        host = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), shapes,
                            is_leaf=lambda x: hasattr(x, "shape"))
        raw = reader.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(restore_args=host)))["state"]
    model, adamw = ModelConfig(**identity["model"]), AdamWConfig(**identity["optimizer"])
    # the kernel is no part of the state: "dense" checks none
    _, programs = preset_programs(model, identity["batch"]["seq_len"], optimizer=adamw,
                                  attention="dense")
    # the decoder's state's shapes, laid out as `programs`' parameters, under its optimizer
    target = TrainState(jax.ShapeDtypeStruct((), np.int32), programs.params,
                        jax.eval_shape(retired_optimizer(adamw).init, programs.params))
    retired = converted_state(raw, target, where)
    state = injected_state(retired, programs.optimizer)
    on_host = jax.device_put(state, jax.devices("cpu")[0])
    run = programs.identity({**identity["data"], **identity["batch"]})
    new_meta = {**meta, "identity": run, "leaves": leaf_shapes(on_host),
                "checksums": state_checksums(on_host)}
    handlers = {"state": state_handler(), "meta": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(destination.absolute(), item_handlers=handlers) as writer:
        writer.save(step, args=ocp.args.Composite(state=save_args(on_host),
                                                  meta=ocp.args.JsonSave(new_meta)))
        writer.wait_until_finished()
    say(f"converted {where} ({model.name}, {len(jax.tree.leaves(state))} arrays) into "
        f"{destination}: resume it with --checkpoint-dir {destination} --resume")
    return step


def _decoder_identity(meta: Mapping[str, Any], where: str) -> dict[str, Any]:
    identity = meta.get("identity")
    if not isinstance(identity, dict) or not retired_layout(identity):
        held = ("no run identity" if not isinstance(identity, dict) else
                f"a run of {identity.get('model', {}).get('class', 'another model')!r}")
        raise CheckpointError(f"{where} is not a checkpoint of the retired built-in decoder "
                              f"({held}); it needs no conversion")
    return identity
