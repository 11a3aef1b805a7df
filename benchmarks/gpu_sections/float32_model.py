"""float32_model: a float32 Llama with head_dim 64 and attention blocks of 128 (the case
whose kernel asked an H100 for 264,192 bytes of shared memory and crashed) trains through
`rh.fit`: the kernel and blocks the library chose, any `KernelFallbackWarning`, the losses
(they must be finite and fall) and the median step time."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np
import optax

import resihp_jax as rh
from benchmarks.gpu_sections.common import Suite, print_table
from benchmarks.gpu_sections.user_path import QUIET, batches
from resihp_jax.attention.check import select_kernel
from resihp_jax.models.config import ModelConfig, get_model_config
from resihp_jax.attention.block_sizes import KernelFallbackWarning


def sizes(quick: bool) -> tuple[ModelConfig, int, int, int]:
    """(model, rows, seq_len, steps)."""
    if quick:  # blocks of 128 on CPU too: rows no shorter than a block
        return get_model_config("tiny", attn_block=128), 2, 128, 4
    model = ModelConfig(name="f32-d64-b128", vocab_size=32_000, d_model=512, n_layers=4,
                        n_heads=8, n_kv_heads=8, d_ff=1408, attn_block=128, dtype="float32")
    return model, 4, 2048, 12


def run(suite: Suite) -> dict[str, Any]:
    model, rows, seq, steps = sizes(suite.quick)
    data = batches(rows, seq, 2, suite.seed)
    plan = rh.Plan.uniform(1, 1, 1, n_layers=model.n_layers, n_microbatches=1,
                           microbatch_size=rows, seq_len=seq)
    choice = select_kernel("auto", platform=jax.default_backend(), seq_len=seq,
                           block_size=model.attn_block, head_dim=model.head_dim,
                           n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, dtype=model.dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", KernelFallbackWarning)
        result = rh.fit(lambda rngs: rh.models.Llama(model, rngs=rngs), (data * steps)[:steps],
                        optimizer=optax.adam(1e-3), plan=plan, steps=steps,
                        devices=[suite.device], progress=False, resilience=QUIET,
                        compute_dtype="float32")
    losses = list(result.losses.values())
    step_s = [r.step_time_s for r in result.records[2:]] if len(result.records) > 2 else []
    row = {"model": model.name, "head_dim": model.head_dim, "attn_block": model.attn_block,
           "rows": f"{rows}x{seq}", "kernel": f"{choice.implementation} "
           f"{choice.block_q}x{choice.block_k}", "steps": steps,
           "first_loss": round(losses[0], 5), "last_loss": round(losses[-1], 5),
           "finite": bool(np.all(np.isfinite(losses))),
           "falls": bool(np.mean(losses[-2:]) < np.mean(losses[:2])),
           "median_step_ms": round(float(np.median(step_s)) * 1e3, 3) if step_s else None,
           "fallback_warnings": [str(w.message).splitlines()[0][:200] for w in caught
                                 if issubclass(w.category, KernelFallbackWarning)]}
    print_table("float32_model: rh.fit of a float32 Llama (no crash; what the kernel chose)",
                [{k: v for k, v in row.items() if k != "fallback_warnings"}],
                [k for k in row if k != "fallback_warnings"])
    for line in row["fallback_warnings"]:
        print(f"  KernelFallbackWarning: {line}")
    return row
