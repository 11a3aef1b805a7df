"""The identity of a run of a user's model and optax optimizer (see recovery/run_identity.py).

Nothing on an optax optimizer says its learning rate or schedule, so it is described by what
it does: its state's structure, the hyper-parameters `optax.inject_hyperparams` keeps there,
and a fingerprint of its updates on a small fixed probe (the parameters' tree, every
dimension cut to at most 3) for a few consecutive steps and at several far-off step counts
(a schedule that differs only late is seen too). The probe runs once, in one program, on a
host CPU device, its values rounded before hashing: the same optimizer built again in another
process gives the same fingerprint. A resume forced past a changed optimizer keeps the state
it restored but takes the injected hyper-parameters as built now
(`with_current_hyperparams`), else the change the user forced would not take effect.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from resihp_jax.runtime.recovery.run_identity import data_identity, json_ready

_CONSECUTIVE_STEPS = 3
_FAR_COUNTS = (10, 100, 1_000, 10_000, 100_000)  # a schedule's later shape
_PROBE_DIM = 3  # each probe leaf keeps its rank, every dimension cut to this
_DIGITS = 5  # significant digits kept of each probe value, relative to its leaf's largest


def model_run_identity(model_name: str, params: Any, optimizer: optax.GradientTransformation,
                      data_state: Mapping[str, Any],
                      config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The identity of a run of `model_name` (the user's class) with canonical `params`
    (arrays or shapes) under `optimizer`, on the data of a `BatchIterator.state()`;
    `config`: what else decides the model's math that its class and shapes do not say (a
    preset's ModelConfig: its dtype, rotary base, norm epsilon)."""
    described = {} if config is None else {"config": dict(config)}
    return json_ready({
        # (a preset's config first: its name heads the differences named)
        "model": {"class": model_name, **described, "params": param_shapes(params)},
        "optimizer": optimizer_identity(optimizer, params),
        **data_identity(data_state),
    })


def param_shapes(params: Any) -> dict[str, str]:
    """'blocks.up.kernel' -> 'dtype[d0,d1,...]' of every parameter."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {".".join(path_names(path)):
            f"{np.dtype(leaf.dtype).name}[{','.join(map(str, leaf.shape))}]"
            for path, leaf in leaves}


def path_names(path: tuple[Any, ...]) -> tuple[str, ...]:
    """A key path as plain names, whatever holds the leaf: a dict, a named tuple's field or a
    list (orbax reads a saved named tuple back as a dict, a tuple as a list)."""
    return tuple(str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))))
                 for key in path)


def optimizer_identity(optimizer: optax.GradientTransformation, params: Any) -> dict[str, Any]:
    """What the optimizer is, read off its state and its updates (module docstring)."""
    shapes = jax.eval_shape(optimizer.init, params)
    try:
        initial, updates = _probe(optimizer, params)
    except Exception as err:  # noqa: BLE001 - e.g. an update that takes extra arguments
        hyperparams: dict[str, Any] = {}
        fingerprint = f"not probed ({type(err).__name__})"
    else:
        hyperparams = injected_hyperparams(initial)
        fingerprint = _fingerprint(updates)
    return {"state": ", ".join(state_types(shapes)) or "none",
            "state_leaves": _digest(param_shapes(shapes)),
            "hyperparams": hyperparams, "updates": fingerprint}


def state_types(state: Any) -> list[str]:
    """The class names of the optimizer state's parts, in order (e.g. ScaleByAdamState)."""
    return [type(node).__name__ for node in _nodes(state) if _is_named_tuple(node)]


def injected_hyperparams(state: Any) -> dict[str, Any]:
    """'path.name' -> rounded value of every scalar hyper-parameter that
    `optax.inject_hyperparams` keeps in `state`."""
    found: dict[str, Any] = {}
    for path, node in _nodes_with_path(state):
        if not _injects(node):
            continue
        for name, value in sorted(node.hyperparams.items()):
            value = np.asarray(value)
            if value.ndim == 0 and np.issubdtype(value.dtype, np.number):
                found[f"{path}{name}"] = float(f"{float(value):.{_DIGITS}g}")
    return found


def with_current_hyperparams(state: Any, optimizer: optax.GradientTransformation) -> Any:
    """`state` (a restored TrainState, on the devices) with every hyper-parameter that
    `optax.inject_hyperparams` keeps in its optimizer state set to `optimizer`'s own
    initial value (the optimizer initialized on a probe of the parameters' tree)."""
    cpu = jax.local_devices(backend="cpu")[0]
    probe = jax.device_put(_probe_tree(state.params, 0.37), cpu)
    current = {path: node.hyperparams for path, node in _nodes_with_path(
        jax.device_get(jax.jit(optimizer.init)(probe))) if _injects(node)}

    def replaced(node: Any, path: str) -> Any:
        if _injects(node) and path in current:
            return node._replace(hyperparams={
                name: _placed(current[path].get(name), value)
                for name, value in node.hyperparams.items()})
        if _is_named_tuple(node):
            return node._replace(**{name: replaced(getattr(node, name), f"{path}{name}.")
                                    for name in node._fields})
        if isinstance(node, (tuple, list)):
            return type(node)(replaced(child, f"{path}{i}.") for i, child in enumerate(node))
        if type(node) is dict:  # e.g. optax.multi_transform's states by label
            return {key: replaced(child, f"{path}{key}.") for key, child in node.items()}
        return node  # a leaf, or a tree of parameters' kind (no injected state below)

    return state._replace(opt_state=replaced(state.opt_state, ""))


def _placed(value: Any, like: Any) -> Any:
    """`value` where `like` is (its dtype and sharding); `like` where `value` does not fit."""
    if value is None or np.shape(value) != np.shape(like) or not hasattr(like, "sharding"):
        return like
    return jax.device_put(np.asarray(value, dtype=like.dtype), like.sharding)


def _injects(node: Any) -> bool:
    return _is_named_tuple(node) and isinstance(getattr(node, "hyperparams", None), Mapping)


def _is_named_tuple(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(node, "_fields")


def _children(node: Any) -> list[Any]:
    # one level of any pytree node: the node itself is flattened, its children are leaves
    if node is None or isinstance(node, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        return []
    children = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)[0]
    return [] if children == [node] else children


def _nodes(node: Any) -> Iterator[Any]:
    yield node
    for child in _children(node):
        yield from _nodes(child)


def _nodes_with_path(tree: Any) -> Iterator[tuple[str, Any]]:
    def walk(node: Any, path: str) -> Iterator[tuple[str, Any]]:
        yield path, node
        if _is_named_tuple(node):
            for name in node._fields:
                yield from walk(getattr(node, name), f"{path}{name}.")
        elif isinstance(node, (tuple, list)):
            for i, child in enumerate(node):
                yield from walk(child, f"{path}{i}.")
        elif isinstance(node, Mapping):
            for key in sorted(node, key=str):
                yield from walk(node[key], f"{path}{key}.")

    yield from walk(tree, "")


def _probe_tree(params: Any, phase: float) -> Any:
    """`params`'s tree, every leaf a small fixed float32 array of the same rank."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    small = []
    for i, leaf in enumerate(leaves):
        shape = tuple(min(d, _PROBE_DIM) for d in leaf.shape)
        values = np.arange(int(np.prod(shape)), dtype=np.float64) + 1.0 + 7.0 * i
        small.append(np.sin(values * phase).reshape(shape).astype(np.float32))
    return jax.tree_util.tree_unflatten(treedef, small)


def _at_count(state: Any, count: int) -> Any:
    """`state` with every integer scalar (the step counts schedules read) set to `count`."""
    def set_count(leaf: Any) -> Any:
        if leaf.ndim == 0 and jnp.issubdtype(leaf.dtype, jnp.integer):
            return jnp.full_like(leaf, count)
        return leaf

    return jax.tree.map(set_count, state)


def _probe(optimizer: optax.GradientTransformation, params: Any) -> tuple[Any, list[Any]]:
    """(initial state, updates) of the optimizer on the probe, computed on a host CPU."""
    cpu = jax.local_devices(backend="cpu")[0]
    probe_params, probe_grads = (jax.device_put(_probe_tree(params, phase), cpu)
                                 for phase in (0.37, 1.13))

    def run(p: Any, g: Any) -> tuple[Any, list[Any]]:
        initial = state = optimizer.init(p)
        updates = []
        for k in range(_CONSECUTIVE_STEPS):
            grads = jax.tree.map(lambda x, k=k: x * (1.0 + 0.5 * k), g)
            update, state = optimizer.update(grads, state, p)
            p = optax.apply_updates(p, update)
            updates.append(update)
        for count in _FAR_COUNTS:
            updates.append(optimizer.update(g, _at_count(state, count), p)[0])
        return initial, updates

    return jax.device_get(jax.jit(run)(probe_params, probe_grads))


def _fingerprint(updates: Any) -> str:
    """A short hash of the updates, each leaf rounded relative to its largest value."""
    parts = []
    for leaf in jax.tree.leaves(updates):
        values = np.asarray(leaf, np.float64)
        scale = float(np.max(np.abs(values))) if values.size else 0.0
        if scale == 0.0 or not np.isfinite(scale):
            parts.append(f"{scale}")
            continue
        digits = np.round(values / scale, _DIGITS) + 0.0  # + 0.0: no -0.0
        parts.append(f"{scale:.{_DIGITS}g}:" + ",".join(f"{d:.{_DIGITS}f}" for d in
                                                        digits.ravel()))
    return _digest(parts)


def _digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]
