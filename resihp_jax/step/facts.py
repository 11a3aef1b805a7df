"""The facts the planner and the cost models need (perfmodel/facts.py), read off a user's model
(parameter shapes, XLA's cost analysis of a block and the head, the block's backward residuals,
logical axis names), assuming nothing about its architecture.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from resihp_jax.errors import ConfigError
from resihp_jax.attention.kernels import TRACED_CALLS
from resihp_jax.step.body import rematted
from resihp_jax.step.model_parts import ModelParts, mesh_specs

ATTENTION_COSTS = ("document", "row")
# two row lengths: FLOPs = a * S + b * S^2 separates a and b. Short rows first (cheap to
# lower); a model that only takes multiples of a larger block (segment attention with
# block_size=128, say) is probed at half and all of the training rows' length, then at
# that length and twice it.
_PROBE_LENGTHS = (64, 128)


@dataclass(frozen=True)
class MeasuredFacts:
    """ModelFacts of a user's model (see perfmodel/facts.py for what each member means)."""
    name: str
    n_layers: int
    dtype: str
    d_model: int
    vocab_size: int
    layer_params: int
    shell_params: int
    layer_flops: float  # per token
    pair_flops: float  # per (query, key) pair
    head_flops: float  # per token
    activation_elements: float  # per token and layer
    kept_elements: float  # per token and layer, under remat "projections"
    sharded_dims: tuple[int, ...]
    attention_cost: str = "row"
    seq_multiple: int = 1

    def layer_param_count(self) -> int:
        return self.layer_params

    # every stage holds the whole shell (embed and head share it); the first and last are
    # the ones that use it
    def first_stage_param_count(self) -> int:
        return self.shell_params

    def last_stage_param_count(self) -> int:
        return self.shell_params

    def param_count(self) -> int:
        return self.shell_params + self.n_layers * self.layer_params

    def layer_flops_per_token(self) -> float:
        return self.layer_flops

    def attention_flops_per_token_pair(self) -> float:
        return self.pair_flops

    def head_flops_per_token(self) -> float:
        return self.head_flops

    def layer_activation_elements(self, tp: int) -> float:
        del tp  # read off one device's residuals: an upper bound under tensor parallelism
        return self.activation_elements

    def layer_kept_elements(self, tp: int) -> float:
        del tp  # likewise
        return self.kept_elements

    def tp_dims(self) -> tuple[int, ...]:
        return self.sharded_dims

    def with_layers(self, n_layers: int) -> MeasuredFacts:
        return dataclasses.replace(self, n_layers=n_layers)


def _size(tree: Any) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


def _flops(fn: Any, *args: Any) -> float:
    # XLA's cost analysis of the lowered program: the same FLOPs without compiling one
    analysis = jax.jit(fn).lower(*args).cost_analysis()
    if isinstance(analysis, list):  # older releases: one dict per program
        analysis = analysis[0] if analysis else {}
    return float((analysis or {}).get("flops", 0.0))


def _tokens(seq: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # numpy, not jnp: eager jnp constructors each compile a small program at start-up
    tokens = np.zeros((1, seq), np.int32)
    return tokens, np.ones((1, seq), np.int32), np.arange(seq, dtype=np.int32)[None]


def model_facts(parts: ModelParts, shell: Any, layers: Any, name: str,
                axis_rules: Sequence[tuple[str, str | None]],
                attention_cost: str | None = None,
                compute_dtype: str | None = None,
                seq_len: int | None = None) -> MeasuredFacts:
    """The facts of a model split by `split_model` (arrays or shapes); `seq_len`, the
    training rows' length, gives probe lengths the model accepts when short rows do not."""
    layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), layers)
    shell = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), shell)
    pairs = [_PROBE_LENGTHS]  # then the training rows' (see _PROBE_LENGTHS)
    if seq_len and seq_len % 2 == 0:
        pairs.append((seq_len // 2, seq_len))
    if seq_len:
        pairs.append((seq_len, 2 * seq_len))
    pairs = list(dict.fromkeys(pairs))
    for i, (s1, s2) in enumerate(pairs):
        calls_before = TRACED_CALLS[0]
        try:
            h, f1, f2 = _block_flops(parts, shell, layer, s1, s2)
            break
        except Exception:  # noqa: BLE001 - a length this model refuses: try the next pair
            if i == len(pairs) - 1:
                raise
    calls_segment_attention = TRACED_CALLS[0] > calls_before
    logits = jax.eval_shape(parts.head, shell, h)
    quadratic = max((f2 / s2 - f1 / s1) / (s2 - s1), 0.0)  # b in f = a*S + b*S^2
    linear = max(f1 / s1 - quadratic * s1, 0.0)
    head = _flops(parts.head, shell, jax.ShapeDtypeStruct((1, s1, h.shape[-1]), h.dtype)) / s1
    return MeasuredFacts(
        name=name, n_layers=parts.n_layers, dtype=compute_dtype or str(np.dtype(h.dtype)),
        d_model=h.shape[-1],
        vocab_size=logits.shape[-1], layer_params=_size(layer), shell_params=_size(shell),
        layer_flops=linear, pair_flops=2.0 * quadratic, head_flops=head,
        activation_elements=_residual_elements(parts, layer, h) / s1,
        kept_elements=_residual_elements(parts, layer, h, "projections") / s1,
        sharded_dims=_tp_dims(parts, shell, layer, axis_rules),
        attention_cost=_attention_cost(attention_cost, calls_segment_attention))


def _block_flops(parts: ModelParts, shell: Any, layer: Any, s1: int, s2: int
                 ) -> tuple[Any, float, float]:
    """(embedding output's shape at s1, one block's FLOPs on a row of s1, of s2 tokens)."""
    tokens, _, pos = _tokens(s1)
    h = jax.eval_shape(parts.embed, shell, tokens, pos)

    def block_flops(seq: int) -> float:
        _, s, q = _tokens(seq)
        x = jax.ShapeDtypeStruct((1, seq, h.shape[-1]), h.dtype)
        return _flops(parts.block, layer, x, s, q)

    return h, block_flops(s1), block_flops(s2)


def _residual_elements(parts: ModelParts, layer: Any, h: Any, remat: str = "none") -> float:
    """Elements one block keeps for its backward on one row under `remat`, its weights not
    counted."""
    _, seg, pos = _tokens(h.shape[1])
    block = rematted(lambda p, x_: parts.block(p, x_, seg, pos), remat)

    def pullback(p: Any, x: jax.Array) -> Any:
        return jax.vjp(lambda x_: block(p, x_), x)[1]

    residuals = jax.eval_shape(pullback, layer, jax.ShapeDtypeStruct(h.shape, h.dtype))
    return float(max(_size(residuals) - _size(layer), 0))


def _tp_dims(parts: ModelParts, shell: Any, layer: Any,
             rules: Sequence[tuple[str, str | None]]) -> tuple[int, ...]:
    dims: list[int] = []
    for params, logical in ((shell, parts.shell_logical), (layer, parts.layer_logical)):
        specs = mesh_specs(logical, rules)
        for leaf, spec in zip(jax.tree.leaves(params),
                              jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
            dims += [leaf.shape[i] for i, axis in enumerate(spec) if axis == "tp"]
    return tuple(sorted(set(dims)))


def _attention_cost(declared: str | None, calls_segment_attention: bool) -> str:
    """How the model's attention work grows: as declared, else 'document' when its blocks
    call our segment attention (which skips pairs of different documents), else 'row' (a
    dense masked attention costs the whole row whatever its documents)."""
    if declared is None:
        return "document" if calls_segment_attention else "row"
    if declared not in ATTENTION_COSTS:
        raise ConfigError(f"attention_cost={declared!r}: valid are {', '.join(ATTENTION_COSTS)}")
    return declared
