"""ModelConfig: the frozen, self-validating description of a decoder's sizes, with presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from resihp_jax.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's sizes (frozen, validated on construction); presets via `get_model_config`."""
    name: str = "tiny"
    vocab_size: int = 256  # byte-level tokens
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    d_ff: int = 176
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    attn_block: int = 16  # query/key block size of the block-sparse attention
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                      "attn_block"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ModelConfig.{field}={value!r}: must be a positive integer")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"ModelConfig: d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"ModelConfig: n_heads={self.n_heads} is not a multiple of "
                f"n_kv_heads={self.n_kv_heads} (grouped KV heads must divide the query heads)")
        if (self.d_model // self.n_heads) % 2:
            raise ConfigError(
                f"ModelConfig: head_dim={self.d_model // self.n_heads} must be even for rotary "
                "positions")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"ModelConfig.dtype={self.dtype!r}: valid are float32, bfloat16")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def layer_param_count(self) -> int:
        attn = self.d_model * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.d_model * self.d_ff
        return attn + mlp + 2 * self.d_model

    def param_count(self) -> int:
        return (self.first_stage_param_count() + self.last_stage_param_count()
                + self.n_layers * self.layer_param_count())

    # ---- ModelFacts (perfmodel/facts.py): what the planner and cost models ask -----------
    @property
    def seq_multiple(self) -> int:
        return self.attn_block

    @property
    def attention_cost(self) -> str:
        return "document"  # the block-sparse kernel skips pairs of different documents

    def first_stage_param_count(self) -> int:
        return self.vocab_size * self.d_model  # the embedding table

    def last_stage_param_count(self) -> int:
        return self.vocab_size * self.d_model + self.d_model  # output projection and norm

    def layer_flops_per_token(self) -> float:
        return 2.0 * self.layer_param_count()  # one multiply-add per weight

    def attention_flops_per_token_pair(self) -> float:
        # QK^T and AV: 2 multiply-adds per pair and model dimension, over l^2 / 2 pairs
        return 2.0 * self.d_model

    def head_flops_per_token(self) -> float:
        return 2.0 * self.vocab_size * self.d_model + 5.0 * self.vocab_size

    def layer_activation_elements(self, tp: int) -> float:
        """Elements per token one layer saves for its backward (norms, QKV, attention out, MLP)."""
        kv_dim = self.n_kv_heads * self.head_dim
        replicated = 4 * self.d_model  # residual stream and norm outputs around attn and MLP
        sharded = 2 * self.d_model + 2 * kv_dim + 3 * self.d_ff  # q, attn out, k, v, MLP
        return replicated + sharded / tp

    def layer_kept_elements(self, tp: int) -> float:
        """Elements per token one layer keeps under remat "projections": the q, k, v, output,
        gate, up and down projections' outputs and the attention output."""
        kv_dim = self.n_kv_heads * self.head_dim
        q_dim = self.n_heads * self.head_dim
        replicated = 2 * self.d_model  # the output and down projections (partial under tp)
        sharded = 2 * q_dim + 2 * kv_dim + 2 * self.d_ff  # q, context, k, v, gate, up
        return replicated + sharded / tp

    def tp_dims(self) -> tuple[int, ...]:
        return (self.n_heads, self.n_kv_heads, self.d_ff, self.vocab_size)

    def with_layers(self, n_layers: int) -> ModelConfig:
        return self.replace(n_layers=n_layers)

    def replace(self, **changes: object) -> ModelConfig:
        return dataclasses.replace(self, **changes)


# `dtype` is the compute dtype; parameters and optimizer state are float32 in every preset.
# Presets that run on CPU in tests compute in float32; GPU-sized ones in bfloat16.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "tiny-gqa": ModelConfig(name="tiny-gqa", n_heads=8, n_kv_heads=2, d_model=64),
    # ~14M parameters: big enough that compute dominates dispatch on CPU.
    "small": ModelConfig(name="small", d_model=384, n_layers=8, n_heads=8, n_kv_heads=8,
                         d_ff=1024, attn_block=64),
    # ~1.1B parameters (TinyLlama-1.1B sizes): one GPU, or a small multi-GPU test bed.
    "llama-1b": ModelConfig(name="llama-1b", vocab_size=32_000, d_model=2048, n_layers=22,
                            n_heads=32, n_kv_heads=4, d_ff=5632, attn_block=128,
                            dtype="bfloat16"),
    # Llama-2-7B sizes.
    "llama2-7b": ModelConfig(name="llama2-7b", vocab_size=32_000, d_model=4096, n_layers=32,
                             n_heads=32, n_kv_heads=32, d_ff=11_008, attn_block=128,
                             dtype="bfloat16"),
    # Llama-2-70B sizes, used by the planner and the cluster simulator (never run on CPU).
    "llama2-70b": ModelConfig(name="llama2-70b", vocab_size=32_000, d_model=8192, n_layers=80,
                              n_heads=64, n_kv_heads=8, d_ff=28_672, attn_block=128,
                              dtype="bfloat16"),
}


def get_model_config(name: str, **overrides: object) -> ModelConfig:
    """The preset called `name`, with any field overridden (e.g. n_layers=80)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; valid: {', '.join(sorted(PRESETS))}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
