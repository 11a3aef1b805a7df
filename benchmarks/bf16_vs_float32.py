"""bf16 compute against float32: the same plan, seed, initial weights and global batches.

Trains one plan twice, with `ModelConfig.dtype` float32 and bfloat16 (float32 masters and
optimizer state in both), and prints each step's loss side by side with their difference,
then the median step time of each (steps after the first two; on CPU bf16 matmuls are
emulated, so only accelerator timings say anything about speed). Defaults: `tiny` on a
dp=2,pp=2,tp=2 plan of 8 fake CPU devices.
No fault is injected: both runs are healthy. Exits 1 if a loss of either run is not finite
(invariant `losses_finite`); how far bf16 drifts from float32 over steps is reported, not
judged (training amplifies it; one step's bf16 tolerance on every mesh is
benchmarks/bf16_meshes.py).
Usage: python benchmarks/bf16_vs_float32.py [--quick] [--model tiny] [--plan 2,2,2] [--steps 8]
       [--microbatches 8] [--microbatch-size 2] [--seq-len 64] [--n-layers N]
       [--attn-block N] [--seed 0]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.invariants import verdict  # noqa: E402
from resihp_jax.data import BatchIterator  # noqa: E402
from resihp_jax.plan import Plan  # noqa: E402
from resihp_jax.models.config import ModelConfig, get_model_config  # noqa: E402
from resihp_jax.runtime.trainer.records import device_batch  # noqa: E402
from resihp_jax.step.config import StepConfig  # noqa: E402
from resihp_jax.runtime.run.programs import preset_programs  # noqa: E402

DTYPES = ("float32", "bfloat16")


def train(model: ModelConfig, plan: Plan, args: argparse.Namespace
          ) -> tuple[np.ndarray, np.ndarray]:
    """Losses and wall times of `args.steps` steps (each timed to its loss on the host)."""
    _, programs = preset_programs(model, plan.seq_len)
    program = programs(StepConfig(), plan, jax.devices())
    data = BatchIterator("synthetic:lognormal", n_microbatches=plan.n_microbatches,
                         microbatch_size=plan.microbatch_size, seq_len=plan.seq_len,
                         seed=args.seed)
    state = program.init_state(args.seed)
    losses, times = [], []
    for _ in range(args.steps):
        batch = data.next_batch()
        sharded = device_batch(program, batch)
        start = time.perf_counter()
        state, metrics = program.step(state, sharded)
        losses.append(float(metrics["loss"]))
        times.append(time.perf_counter() - start)
    return np.asarray(losses), np.asarray(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="model preset (default: tiny)")
    parser.add_argument("--plan", default="2,2,2", help="dp,pp,tp (default: 2,2,2)")
    parser.add_argument("--steps", type=int, default=None,
                        help="train steps (default: 8; 4 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="4 steps a run (the first two compile, two are timed)")
    parser.add_argument("--microbatches", type=int, default=8, help="global micro-batches")
    parser.add_argument("--microbatch-size", type=int, default=2, help="rows per micro-batch")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per row")
    parser.add_argument("--n-layers", type=int, default=None, help="override the layer count")
    parser.add_argument("--attn-block", type=int, default=None,
                        help="override the attention block size")
    parser.add_argument("--seed", type=int, default=0, help="weights and data seed")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 4 if args.quick else 8
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: must be >= 1")
    dp, pp, tp = (int(x) for x in args.plan.split(","))
    overrides = {k: v for k, v in (("n_layers", args.n_layers), ("attn_block", args.attn_block))
                 if v is not None}
    base = get_model_config(args.model, **overrides)
    plan = Plan.uniform(dp, pp, tp, n_layers=base.n_layers, n_microbatches=args.microbatches,
                        microbatch_size=args.microbatch_size, seq_len=args.seq_len)
    runs = {d: train(base.replace(dtype=d), plan, args) for d in DTYPES}
    f32, bf16 = runs["float32"][0], runs["bfloat16"][0]
    rel = np.abs(bf16 - f32) / np.abs(f32)
    print(f"{args.model} ({base.param_count() / 1e6:.1f}M params), plan {dp}/{pp}/{tp}, "
          f"{jax.devices()[0].platform}; faults: none")
    print(f"{'step':>4} {'float32':>10} {'bfloat16':>10} {'bf16-f32':>10} {'rel':>9}")
    for i, (a, b) in enumerate(zip(f32, bf16, strict=True)):
        print(f"{i:>4} {a:>10.5f} {b:>10.5f} {b - a:>+10.5f} {rel[i]:>9.2e}")
    step_s = {d: float(np.median(runs[d][1][2:])) if args.steps > 2 else float("nan")
              for d in DTYPES}
    print(f"median step: float32 {step_s['float32'] * 1e3:.1f} ms, bfloat16 "
          f"{step_s['bfloat16'] * 1e3:.1f} ms, ratio f32/bf16 "
          f"{step_s['float32'] / step_s['bfloat16']:.2f}")
    ok = np.isfinite(bf16) & np.isfinite(f32)
    finite = bool(ok.all())
    print(json.dumps({"model": args.model, "plan": [dp, pp, tp],
                      "platform": jax.devices()[0].platform,
                      "loss_float32": f32.round(5).tolist(),
                      "loss_bfloat16": bf16.round(5).tolist(), "max_rel_diff": float(rel.max()),
                      "all_finite": bool(np.isfinite(bf16).all()), "median_step_s": step_s,
                      "invariants": {"losses_finite": finite}}))
    return verdict({"losses_finite": finite},
                   {"losses_finite": f"steps {np.flatnonzero(~ok).tolist()} not finite"},
                   "bf16_vs_float32.py")


if __name__ == "__main__":
    sys.exit(main())
