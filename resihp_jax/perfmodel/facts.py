"""ModelFacts: all the cost and memory models, the scheduler and the simulator may ask of a
model: a `ModelConfig` answers from its sizes, a user's NNX model from its parameter shapes and
XLA's cost analysis of one block (step/facts.py). Nothing else reads a model's sizes directly.
"""

from __future__ import annotations

from typing import Protocol


class ModelFacts(Protocol):
    name: str
    n_layers: int
    dtype: str  # compute dtype name: 'float32' or 'bfloat16'
    d_model: int  # elements per token passed from layer to layer (and stage to stage)
    vocab_size: int

    @property
    def seq_multiple(self) -> int:
        """A row's length must be a multiple of this (the attention's block size)."""
        ...

    @property
    def attention_cost(self) -> str:
        """'document': attention work grows with the sum of squared document lengths;
        'row': with the squared row length (dense masked attention)."""
        ...

    def layer_param_count(self) -> int:
        """Parameters of one layer (block)."""
        ...

    def first_stage_param_count(self) -> int:
        """Parameters the first pipeline stage holds besides its layers (the embedding)."""
        ...

    def last_stage_param_count(self) -> int:
        """Parameters the last pipeline stage holds besides its layers (the head)."""
        ...

    def param_count(self) -> int:
        ...

    def layer_flops_per_token(self) -> float:
        """Forward FLOPs of one layer per token, the part linear in tokens."""
        ...

    def attention_flops_per_token_pair(self) -> float:
        """Forward FLOPs of one layer per (query, key) pair that attention computes."""
        ...

    def head_flops_per_token(self) -> float:
        """Forward FLOPs of the head (logits and softmax) per token."""
        ...

    def layer_activation_elements(self, tp: int) -> float:
        """Elements per token one layer saves for its backward pass on `tp` devices."""
        ...

    def layer_kept_elements(self, tp: int) -> float:
        """Elements per token one layer keeps under remat "projections" (its matmuls' outputs
        and its attention output) on `tp` devices."""
        ...

    def tp_dims(self) -> tuple[int, ...]:
        """Dimensions that tensor parallelism shards: a valid tp divides each."""
        ...

    def with_layers(self, n_layers: int) -> ModelFacts:
        """The same model with `n_layers` layers (the planner's probes)."""
        ...
