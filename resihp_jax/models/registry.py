"""Every model a command can name, importable without JAX (docs/DESIGN.md, "One registry"):
the Llama presets, which state their facts, and `gpt2`, whose facts XLA measures once built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Union

from resihp_jax.errors import ConfigError
from resihp_jax.models.config import PRESETS, ModelConfig

# rh.models.GPT2's plan when none is given: on 8 fake CPU devices dp=4,pp=2 ran the same 12
# steps of the same batches in 81 s of CPU against 100 s for dp=2,pp=4 (two stages: fewer
# pipeline ticks, a smaller bubble), and re-plans more finely around a slow device (four DP
# groups share the micro-batches; 2 layers per stage can move one off a slow stage)
GPT2_PLAN = "dp=4,pp=2,tp=1"


@dataclass(frozen=True)
class GPT2Sizes:
    """`rh.models.GPT2` at sizes that train fast on 8 fake CPU devices; what a plan's checks ask
    of a model before JAX starts (Plan.check)."""
    name: str
    d_model: int
    n_heads: int
    n_layers: int
    vocab_size: int = 256  # byte tokens: the corpus and the synthetic data
    attn_block: int = 32  # its segment_attention's block: a row is a multiple of it
    dtype: str = "float32"  # 'bfloat16': bf16 compute from float32 weights (rh.fit's)
    learning_rate: float = 3e-3  # the example's own optimizer: optax.adamw(3e-3)
    # nothing on 'tp': its facts then shard no dimension and the scheduler plans tp == 1 only,
    # where its step is manual over every mesh axis, so stage timing and injected slowdowns
    # reach it (with tp > 1 XLA would own 'tp' and a slowdown would silently drop out)
    axis_rules: tuple[tuple[str, str | None], ...] = ()

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model}: must be a multiple of "
                              f"n_heads={self.n_heads}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype={self.dtype!r}: valid: float32, bfloat16")

    @property
    def seq_multiple(self) -> int:
        return self.attn_block

    def tp_dims(self) -> tuple[int, ...]:
        return ()  # its axis rules shard nothing over 'tp'

    def replace(self, **changes: Any) -> GPT2Sizes:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        return (f"{self.name} ({self.dtype}; your own NNX model rh.models.GPT2, "
                f"d={self.d_model}, {self.n_heads} heads, {self.n_layers} blocks, through "
                "rh.fit's path)")


Entry = Union[ModelConfig, GPT2Sizes]
MODELS: Mapping[str, Entry] = {**PRESETS,
                               "gpt2": GPT2Sizes("gpt2", d_model=64, n_heads=4, n_layers=4)}


def get_model(name: str, flag: str = "model", **overrides: Any) -> Entry:
    """The entry called `name`, with any field overridden (e.g. dtype='bfloat16')."""
    if name not in MODELS:
        raise ConfigError(f"{flag}={name!r}: not a model; valid: {', '.join(sorted(MODELS))}")
    return MODELS[name].replace(**overrides) if overrides else MODELS[name]


def states_facts(entry: Entry) -> bool:
    """Whether the model states its facts (the planner can plan it without building it)."""
    return isinstance(entry, ModelConfig)


def planned_model(name: str, flag: str = "--model", **overrides: Any) -> ModelConfig:
    """The entry called `name` for the planner and the simulator, which run without JAX: a
    model that states its facts."""
    entry = get_model(name, flag, **overrides)
    if not isinstance(entry, ModelConfig):
        stated = ", ".join(n for n in sorted(MODELS) if states_facts(MODELS[n]))
        raise ConfigError(f"{flag}={name!r}: its facts are measured once it is built, so the "
                          f"planner cannot plan it ahead; valid: {stated}")
    return entry


def check_plan(entry: Entry, plan: Any, name: str) -> None:
    """Refuse a plan the model cannot train on, naming `name` (a flag or a field) and what is
    valid: a GPT2Sizes trains at tp = 1 only (a Llama has its own tensor parallelism)."""
    if isinstance(entry, GPT2Sizes) and plan.tp != 1:
        raise ConfigError(
            f"{name}: tp={plan.tp} with model {entry.name!r}: it trains on plans with "
            f"tp=1 (where stage timing and injected slowdowns reach it); give tp=1, e.g. "
            f"{GPT2_PLAN} or dp=2,pp=4,tp=1")


def factory(entry: Entry, seq_len: int) -> Callable[[Any], Any]:
    """The function `nnx.Rngs -> model` of `entry`, for rows of `seq_len` tokens."""
    if isinstance(entry, ModelConfig):
        def make_llama(rngs: Any) -> Any:
            from resihp_jax.models.llama import Llama  # noqa: PLC0415 - JAX on first build
            return Llama(entry, rngs=rngs)
        return make_llama

    def make_gpt2(rngs: Any) -> Any:
        from resihp_jax.models.gpt2 import GPT2  # noqa: PLC0415
        return GPT2(vocab=entry.vocab_size, d=entry.d_model, heads=entry.n_heads,
                    layers=entry.n_layers, max_len=seq_len, rngs=rngs)
    return make_gpt2
