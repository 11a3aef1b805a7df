"""A user's Flax NNX model, taken apart for the pipeline and put back together after training.

The contract: an `nnx.Module` with `embed(tokens_BxS, positions_BxS) -> h_BxSxD`, `blocks` (an
`nnx.List` or a list, of blocks of one structure, each `block(h_BxSxD, segment_ids_BxS,
positions_BxS) -> h_BxSxD`) and `head(h_BxSxD) -> logits_BxSxV`. Its parameters are split into
the *shell* and the *layers* stacked `[n_layers, ...]` (docs/DESIGN.md, "The user's own model");
logical axis names (`nnx.with_partitioning`) travel beside them as PartitionSpecs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from resihp_jax.errors import ConfigError
from resihp_jax.meshes.mesh import AXES

# Megatron-style tensor parallelism by default: these logical names go on 'tp', every other
# name on no mesh axis. A user passes their own pairs as `axis_rules` (nnx.logical_axis_rules
# format: (logical name, mesh axis or None)).
DEFAULT_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("vocab", "tp"), ("mlp", "tp"), ("heads", "tp"), ("kv", "tp"))
TENSOR_PARALLEL = ("auto", "manual")  # a model's `tensor_parallel` (ModelParts says what)


@dataclass(frozen=True)
class ModelParts:
    """The static halves of a user's model and the logical specs of its parameters."""
    shell_def: Any  # graphdef of the model with `blocks` emptied
    shell_tree: Any  # treedef of its nnx.State of parameters
    shell_rest: Any  # the shell's non-parameter state (kept as it is, never trained)
    block_def: Any  # graphdef of one block
    block_tree: Any
    block_rest: Any  # one block's non-parameter state
    blocks_type: type  # list or nnx.List: what the user's `blocks` was
    n_layers: int
    shell_logical: Any  # pure dict of PartitionSpecs with logical names, like the shell
    layer_logical: Any  # the same for one block (without the layer dimension)
    name: str = "model"  # the user's class name (checkpoints record it)
    # its blocks or shell keep random streams (nnx.Dropout(rngs=...)): each call then draws
    # from keys the step folds its `noise` into
    draws: bool = False
    # "auto": tensor parallelism from the shardings (XLA splits the blocks); "manual": the
    # blocks see their own shards and finish the partial sums (rh.nn.tp_sum, vocab_embed),
    # and the head returns this device's slice of the vocabulary's logits
    tensor_parallel: str = "auto"

    def embed(self, shell: Any, tokens_BxS: jax.Array, positions_BxS: jax.Array,
              noise: Noise | None = None) -> jax.Array:
        return self._shell(shell, noise).embed(tokens_BxS, positions_BxS)

    def head(self, shell: Any, h_BxSxD: jax.Array, noise: Noise | None = None) -> jax.Array:
        return self._shell(shell, noise).head(h_BxSxD)

    def block(self, layer: Any, h_BxSxD: jax.Array, seg_BxS: jax.Array,
              pos_BxS: jax.Array, noise: Noise | None = None) -> jax.Array:
        block = nnx.merge(self.block_def, _state(self.block_tree, layer),
                          _reseeded(self.block_rest, noise) if self.draws else self.block_rest)
        return block(h_BxSxD, seg_BxS, pos_BxS)

    def _shell(self, shell: Any, noise: Noise | None = None) -> Any:
        return nnx.merge(self.shell_def, _state(self.shell_tree, shell),
                         _reseeded(self.shell_rest, noise) if self.draws else self.shell_rest)

    def assemble(self, shell: Any, layers: Any) -> Any:
        """A model of the user's class from a shell and canonical layers `[n_layers, ...]`."""
        model = self._shell(shell)
        # each block its own copy of the non-parameter state (merging one State twice would
        # share its Variables), a random stream's key folded with the block's index
        blocks = [nnx.merge(self.block_def, _state(self.block_tree,
                                                   jax.tree.map(lambda a, i=i: a[i], layers)),
                            _reseeded(self.block_rest, (i,)) if self.draws else self.block_rest)
                  for i in range(self.n_layers)]
        model.blocks = self.blocks_type(blocks)
        return model


# (step, site, global micro-batch): what a call's random keys are folded with. The site is
# the layer's canonical index (the embedding n_layers, the head n_layers + 1), the micro-batch
# its index in the global batch: the same draws under every plan, and a fresh one each step.
Noise = tuple[jax.Array, jax.Array, jax.Array]


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _reseeded(rest: Any, noise: tuple[Any, ...] | None) -> Any:
    """Fresh copies of the non-parameter state (a stream's count can only be advanced by a
    variable of the trace that uses it), every random stream's key folded with `noise`."""
    def fresh(v: nnx.Variable) -> nnx.Variable:
        value = v.get_value()
        if isinstance(v, nnx.RngKey) and noise is not None:
            for part in noise:
                value = jax.random.fold_in(value, part)
        return v.replace(value=value)

    return jax.tree.map(fresh, rest, is_leaf=_is_variable)


def _state(treedef: Any, pure: Any) -> nnx.State:
    """The nnx.State of parameters whose values are the leaves of `pure` (same key order:
    checked once in `_treedef`)."""
    return jax.tree.unflatten(treedef, jax.tree.leaves(pure))


def _treedef(params: nnx.State) -> Any:
    """Treedef of `params`, after checking its leaves come in its pure dict's order."""
    def keys(tree: Any) -> list[str]:
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return [jax.tree_util.keystr(p).removesuffix(".value") for p, _ in flat]

    if keys(params) != keys(nnx.to_pure_dict(params)):
        raise ConfigError("model parameters: their nnx.State and pure-dict orders differ "
                          "(unsupported Variable layout)")
    return jax.tree.structure(params)


def split_model(model: Any) -> tuple[ModelParts, Any, Any]:
    """(parts, shell params, canonical layer params) of a user's model; ConfigError naming
    what breaks the contract."""
    check_contract(model)
    check_state(model)
    blocks = model.blocks
    blocks_type = type(blocks) if isinstance(blocks, (list, nnx.List)) else list
    try:
        model.blocks = nnx.List([])
        shell_def, shell_params, shell_rest = nnx.split(model, nnx.Param, ...)
    finally:
        model.blocks = blocks
    layer_splits = [nnx.split(b, nnx.Param, ...) for b in blocks]
    block_def, _, block_rest = layer_splits[0]
    _check_same_blocks([(d, p) for d, p, _ in layer_splits])
    mode = getattr(model, "tensor_parallel", "auto")
    if mode not in TENSOR_PARALLEL:
        raise ConfigError(f"model {type(model).__name__}: tensor_parallel={mode!r}; expected "
                          f"one of {TENSOR_PARALLEL}")
    draws = any(isinstance(v, nnx.RngKey) for rest in (shell_rest, block_rest)
                for v in jax.tree.leaves(rest, is_leaf=_is_variable))
    parts = ModelParts(shell_def, _treedef(shell_params), shell_rest, block_def,
                       _treedef(layer_splits[0][1]), block_rest, blocks_type, len(blocks),
                       _logical(shell_params), _logical(layer_splits[0][1]),
                       type(model).__name__, draws, mode)
    layers = _stack_layers([nnx.to_pure_dict(p) for _, p, _ in layer_splits])
    return parts, nnx.to_pure_dict(shell_params), layers


def _stack_layers(per_layer: list[Any]) -> Any:
    """The blocks' parameters stacked [n_layers, ...] leaf by leaf (shapes stay shapes), in
    one program: stacking leaf by leaf eagerly compiled one program per parameter shape."""
    if isinstance(jax.tree.leaves(per_layer[0])[0], jax.ShapeDtypeStruct):
        return jax.tree.map(lambda *xs: jax.ShapeDtypeStruct((len(xs),) + tuple(xs[0].shape),
                                                            xs[0].dtype), *per_layer)
    return jax.jit(lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees))(per_layer)


def check_contract(model: Any) -> None:
    if not isinstance(model, nnx.Module):
        raise ConfigError(f"model: expected an nnx.Module (or a function rngs -> model), got "
                          f"{type(model).__name__}")
    name = type(model).__name__
    for attr in ("embed", "blocks", "head"):
        if not hasattr(model, attr):
            raise ConfigError(f"model {name} has no `{attr}`: a model needs embed(tokens, "
                              "positions), blocks (a list of identical blocks) and head(h)")
    for attr in ("embed", "head"):
        if not callable(getattr(model, attr)):
            raise ConfigError(f"model {name}.{attr} is not callable")
    blocks = model.blocks
    if not isinstance(blocks, Sequence) and not isinstance(blocks, nnx.List):
        raise ConfigError(f"model {name}.blocks is a {type(blocks).__name__}: expected a list "
                          "or nnx.List of blocks")
    if len(blocks) == 0:
        raise ConfigError(f"model {name}.blocks is empty: the pipeline needs at least one block")
    for i, block in enumerate(blocks):
        if not isinstance(block, nnx.Module) or not callable(block):
            raise ConfigError(f"model {name}.blocks[{i}] is a {type(block).__name__}: expected "
                              "a callable nnx.Module block(h, segment_ids, positions)")


def check_state(model: Any) -> None:
    """ConfigError for state that training would have to update besides the parameters:
    the step carries the parameters and the optimizer's state only, so a running statistic
    (BatchNorm) would stay frozen. A dropout draws from its own stream's key, folded by the
    step with the step, the layer and the micro-batch (`Noise`): it needs a stream."""
    name = type(model).__name__
    for path, node in nnx.iter_graph(model):
        where = f"model {name}." + ".".join(str(p) for p in path)
        if (isinstance(node, nnx.Dropout) and node.rate > 0 and not node.deterministic
                and node.rngs is None):
            raise ConfigError(f"{where} is a Dropout with rate {node.rate} and no rngs: give "
                              "it a stream (nnx.Dropout(rate, rngs=rngs)), from which the "
                              "step draws fresh keys, or set deterministic=True")
        if isinstance(node, nnx.BatchStat):
            raise ConfigError(f"{where} is a BatchStat (running statistics, e.g. BatchNorm): "
                              "rh.fit trains nnx.Param only and would leave it frozen; use "
                              "a normalization without running statistics (LayerNorm, RMSNorm)")


def _check_same_blocks(splits: list[tuple[Any, Any]]) -> None:
    def shapes(params: Any) -> Any:
        return jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), nnx.to_pure_dict(params))

    first_def, first = splits[0]
    for i, (graphdef, params) in enumerate(splits[1:], start=1):
        if graphdef != first_def or shapes(params) != shapes(first):
            raise ConfigError(f"model blocks[{i}] differs in structure from blocks[0] (its "
                              "parameters or submodules): the pipeline stacks identical blocks")


def _logical(params: nnx.State) -> Any:
    """A pure dict of PartitionSpecs of logical names (P() for unannotated parameters)."""
    specs = nnx.to_pure_dict(nnx.get_partition_spec(params))
    return jax.tree.map(lambda s: s if isinstance(s, P) else P(), specs,
                        is_leaf=lambda x: isinstance(x, P) or x is None)


def mesh_specs(logical: Any, rules: Sequence[tuple[str, str | None]]) -> Any:
    """Logical PartitionSpecs -> mesh-axis PartitionSpecs under `rules`."""
    table = dict(rules)
    for name, axis in table.items():
        if axis is not None and axis not in AXES:
            raise ConfigError(f"axis_rules: {name!r} -> {axis!r}: valid mesh axes are "
                              f"{', '.join(AXES)} or None")

    def one(spec: P) -> P:
        return P(*(table.get(n) if isinstance(n, str) else None for n in spec))

    return jax.tree.map(one, logical, is_leaf=lambda x: isinstance(x, P))


def check_divisible(params: Any, specs: Any, sizes: dict[str, int], where: str) -> None:
    """ConfigError naming a parameter dimension that its mesh axis does not divide."""
    def one(path: Any, leaf: Any, spec: P) -> None:
        for dim, axis in enumerate(spec):
            if axis is not None and leaf.shape[dim] % sizes[axis]:
                raise ConfigError(
                    f"{where}{jax.tree_util.keystr(path)} has shape {tuple(leaf.shape)}: "
                    f"dimension {dim} ({leaf.shape[dim]}) is sharded over {axis!r}, whose "
                    f"{sizes[axis]} devices do not divide it; choose another {axis} or "
                    "change axis_rules")

    jax.tree_util.tree_map_with_path(one, params, specs,
                                     is_leaf=lambda x: isinstance(x, P))


def abstract_model(make: Callable[[nnx.Rngs], Any], seed: int) -> Any:
    """A model from `make(rngs)` built as shapes only (nothing allocated)."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: make(nnx.Rngs(seed)))


def fully_manual(parts: ModelParts, plan: Any) -> bool:
    """Whether `plan`'s step of the model is manual over every mesh axis (tp == 1, or the
    model's blocks do their own tensor parallelism)."""
    return plan.tp == 1 or parts.tensor_parallel == "manual"
