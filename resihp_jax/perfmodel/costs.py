"""CostParams: the coefficients of the per-stage cost model, in seconds and bytes per second.

Forward time of one layer on one micro-batch (healthy device, tp=1) is
`c + alpha * tokens + beta * sum_i l_i**2`; backward is `bwd_ratio` times that. `for_model`
derives GPU-like defaults from FLOP counts for planning and cluster simulation; `online.py`
learns the coefficients from observed steps instead.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from resihp_jax.errors import ConfigError
from resihp_jax.perfmodel.facts import ModelFacts

_POSITIVE = ("bwd_ratio", "p2p_bandwidth", "tp_bandwidth", "dp_bandwidth")
_NON_NEGATIVE = ("c", "alpha", "beta", "head_alpha", "embed_alpha", "tick_overhead",
                 "step_overhead", "p2p_latency", "tp_latency", "dp_latency")


# Parameters, their gradients and the optimizer moments are float32 whatever the compute
# dtype (`ModelFacts.dtype`, which sets activations and the per-step weight copy).
MASTER_BYTES = 4

# What a step keeps for its backward pass (`StepConfig.remat`): "none" keeps every
# activation; "projections" keeps the matmuls' outputs (dots without batch dimensions: the
# q/k/v, output and MLP projections) and the activation a model names "context" (its
# attention output), and recomputes the rest (norms, activations, the attention kernel):
# MaxText's `minimal_with_context`; "full" recomputes each stage's forward. True and False
# mean "full" and "none"; the cost model charges a recomputed forward for "full" only.
REMAT_POLICIES = ("none", "projections", "full")
# "auto": per plan, the least recomputing of REMAT_POLICIES whose step fits the devices'
# memory (runtime/programs/remat_choice.py). Planning takes it as "full": a plan is admitted
# where some policy fits it, and charged the most recomputation it may need.
REMAT_AUTO = "auto"

# "auto" head chunks (`StepConfig.loss_chunks`) split a micro-batch's head and loss into
# token chunks once its float32 logits pass this size: Llama 3's vocabulary (128,256) at
# 4 x 2048 tokens (4.2 GB) stays whole, at 16 x 2048 (16.8 GB) it runs in 4 chunks; the
# llama-1b preset's (32,000) stays whole at 16 x 2048 (4.2 GB).
LOGITS_CHUNK_BYTES = 4 * 2**30


def remat_name(remat: bool | str) -> str:
    """The policy `remat` names (True: "full", False: "none"; REMAT_AUTO plans as "full")."""
    if isinstance(remat, bool):
        return "full" if remat else "none"
    return "full" if remat == REMAT_AUTO else remat


def recomputes_forward(remat: bool | str) -> bool:
    """The backward recomputes each stage's whole forward."""
    return remat_name(remat) == "full"


def dtype_bytes(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


@dataclass(frozen=True)
class CostParams:
    c: float
    alpha: float
    beta: float
    bwd_ratio: float = 2.0
    head_alpha: float = 0.0  # head + loss per token, last stage
    # per pipeline tick (gpipe) or per op (1f1b), also empty ticks; a slow device does it slower
    tick_overhead: float = 0.0
    p2p_bandwidth: float = math.inf
    p2p_latency: float = 0.0
    tp_bandwidth: float = math.inf
    tp_latency: float = 0.0
    dp_bandwidth: float = math.inf
    dp_latency: float = 0.0
    tp_efficiency: float = 1.0
    embed_alpha: float = 0.0  # embedding lookup (and its backward) per token, first stage
    step_overhead: float = 0.0  # once per step: optimizer update, dispatch

    def __post_init__(self) -> None:
        for name in _POSITIVE + _NON_NEGATIVE + ("tp_efficiency",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"CostParams.{name}={value!r}: must be a number")
            object.__setattr__(self, name, float(value))
        for name in _NON_NEGATIVE:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ConfigError(f"CostParams.{name}={value!r}: must be finite and >= 0")
        for name in _POSITIVE:
            value = getattr(self, name)
            if math.isnan(value) or value <= 0.0:
                raise ConfigError(f"CostParams.{name}={value!r}: must be > 0 (inf allowed)")
        if not (0.0 < self.tp_efficiency <= 1.0):
            raise ConfigError(f"CostParams.tp_efficiency={self.tp_efficiency!r}: must be in (0, 1]")

    def replace(self, **changes: Any) -> CostParams:
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_model(cls, model: ModelFacts, *, device_flops: float = 300e12, mfu: float = 0.5,
                  layer_overhead_s: float = 30e-6, tick_overhead_s: float = 20e-6,
                  nvlink_bandwidth: float = 200e9, nvlink_latency: float = 10e-6,
                  network_bandwidth: float = 25e9, network_latency: float = 15e-6,
                  tp_efficiency: float = 0.9, step_overhead_s: float = 0.0) -> CostParams:
        """GPU-like defaults (A100/H100 class, NVLink TP, InfiniBand p2p and dp) from FLOPs."""
        if not (device_flops > 0 and 0 < mfu <= 1):
            raise ConfigError(f"device_flops={device_flops!r} must be > 0 and mfu={mfu!r} in "
                              "(0, 1]")
        rate = device_flops * mfu
        # the model's own forward FLOPs: per token of a layer, per attended (query, key)
        # pair of a layer (the l^2 term), per token of the head
        return cls(
            c=layer_overhead_s,
            alpha=model.layer_flops_per_token() / rate,
            beta=model.attention_flops_per_token_pair() / rate,
            head_alpha=model.head_flops_per_token() / rate,
            embed_alpha=0.0,
            tick_overhead=tick_overhead_s,
            p2p_bandwidth=network_bandwidth, p2p_latency=network_latency,
            tp_bandwidth=nvlink_bandwidth, tp_latency=nvlink_latency,
            dp_bandwidth=network_bandwidth, dp_latency=network_latency,
            tp_efficiency=tp_efficiency, step_overhead=step_overhead_s)
