"""What the remat policies and the head's token chunks buy a step: memory and time.

One `rh.models.Llama` (the `tiny` preset with a large vocabulary, so the logits weigh as
llama-1b's do against its activations) at 1/1/1 on one CPU device, its programs
(`preset_programs`) called once per setting of `StepConfig(remat=..., loss_chunks=...)`. Per
row: the compiled step's temporaries (XLA's memory analysis, per device), the median step
time over interleaved rounds, and both against the first row (`none`, logits whole) measured
in the same run. Every row trains the same first step on the same batch: its loss is
printed, and must agree (the policies recompute, they do not change the math). No faults
are injected.

Then what `remat="auto"` would choose on a GPU: the memory model's bytes per device for the
llama-1b preset at 1/1/1 under each policy, and the policy chosen for an H100's and an
H200's usable memory (XLA's default 75% of 80 and 141 GB), with no device needed.

Usage: python benchmarks/step_memory.py [--quick] [--vocab V] [--seq-len S] [--rounds R]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from resihp_jax.plan import Plan  # noqa: E402
from resihp_jax.models.config import get_model_config  # noqa: E402
from resihp_jax.perfmodel.costs import REMAT_POLICIES  # noqa: E402
from resihp_jax.perfmodel.memory import memory_bytes_per_device  # noqa: E402
from resihp_jax.perfmodel.memory import remat_for_memory  # noqa: E402
from resihp_jax.runtime.run.programs import preset_programs  # noqa: E402
from resihp_jax.step.config import StepConfig  # noqa: E402
from resihp_jax.step.program import abstract_args  # noqa: E402

ROWS = (("none", 1), ("none", 4), ("projections", 1), ("projections", 4), ("full", 1),
        ("full", 4))
QUICK_ROWS = (("none", 1), ("none", 4), ("projections", 1), ("full", 4))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 rows, a shorter sequence")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary size")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per row (default 512; --quick 256)")
    parser.add_argument("--rows", type=int, default=4, help="rows per step")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; "
                        "--quick 3)")
    args = parser.parse_args()
    args.seq_len = args.seq_len or (256 if args.quick else 512)
    args.rounds = args.rounds or (3 if args.quick else 5)
    for name in ("vocab", "seq_len", "rows", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.seq_len % 4:
        parser.error(f"--seq-len={args.seq_len}: must be a multiple of 4 (the chunked rows "
                     "split it in 4)")
    return args


def build(remat: str, chunks: int, args: argparse.Namespace):
    """(step program, its initial state, the batch, the compiled step's temporaries)."""
    model = get_model_config("tiny").replace(vocab_size=args.vocab)
    plan = Plan.uniform(1, 1, 1, n_layers=model.n_layers, n_microbatches=1,
                        microbatch_size=args.rows, seq_len=args.seq_len)
    _, programs = preset_programs(model, plan.seq_len)
    program = programs(StepConfig(remat=remat, loss_chunks=chunks), plan, jax.devices()[:1])
    compiled = program.step_fn.lower(*abstract_args(program)).compile()
    rng = np.random.default_rng(0)
    shape = (1, args.rows, args.seq_len)
    batch = program.shard_batch(rng.integers(0, args.vocab, shape, dtype=np.int32),
                                np.ones(shape, np.int32),
                                np.broadcast_to(np.arange(args.seq_len, dtype=np.int32), shape))
    return program, program.init_state(0), batch, int(compiled.memory_analysis().temp_size_in_bytes)


GPU_MEMORY_GB = {"H100": 0.75 * 80e9 / 2**30, "H200": 0.75 * 141e9 / 2**30}


def memory_model_choices() -> dict[str, dict]:
    """The memory model's GiB per device under each policy for llama-1b at 4 x 2048 and
    16 x 2048, and the policy `remat="auto"` takes on each GPU."""
    model = get_model_config("llama-1b")
    out = {}
    print(f"\nmemory model, {model.name} at 1/1/1 (GiB a device; what remat='auto' takes)")
    for rows in (4, 16):
        plan = Plan.uniform(1, 1, 1, n_layers=model.n_layers, n_microbatches=1,
                            microbatch_size=rows, seq_len=2048)
        need = {p: round(float(memory_bytes_per_device(plan, model, remat=p).max()) / 2**30, 1)
                for p in REMAT_POLICIES}
        chosen = {gpu: remat_for_memory(model, plan, gb)[0] for gpu, gb in GPU_MEMORY_GB.items()}
        out[f"{rows}x2048"] = {"gib": need, "auto": chosen}
        print(f"  {rows:>2} x 2048: " + ", ".join(f"{p} {g}" for p, g in need.items())
              + "; auto: " + ", ".join(f"{gpu} {c}" for gpu, c in chosen.items()))
    return out


def main() -> None:
    args = parse_args()
    rows = QUICK_ROWS if args.quick else ROWS
    logits = args.rows * args.seq_len * args.vocab * 4
    print(f"tiny with vocabulary {args.vocab}, {args.rows} x {args.seq_len} tokens, 1/1/1 on "
          f"one CPU device; float32 logits {logits / 2**20:.0f} MiB a step; no faults")
    built = {row: build(*row, args) for row in rows}
    losses, times = {}, {row: [] for row in rows}
    states = {row: built[row][1] for row in rows}
    for row in rows:  # the first step of each: its loss, and its compile out of the timings
        program, _, batch, _ = built[row]
        states[row], metrics = program.step(states[row], batch)
        losses[row] = float(metrics["loss"])
    for _ in range(args.rounds):
        for row in rows:
            program, _, batch, _ = built[row]
            start = time.perf_counter()
            states[row], metrics = program.step(states[row], batch)
            jax.block_until_ready(metrics)
            times[row].append(time.perf_counter() - start)
    base = rows[0]
    base_temp, base_time = built[base][3], statistics.median(times[base])
    print(f"\n{'remat':<12} {'chunks':>6} {'temp MiB':>9} {'vs first':>9} {'step s':>8} "
          f"{'vs first':>9} {'loss':>10}")
    out = {}
    for row in rows:
        temp, step = built[row][3], statistics.median(times[row])
        name = f"{row[0]}/{row[1]}"
        out[name] = {"temp_bytes": temp, "temp_ratio": round(temp / base_temp, 3),
                     "step_s": round(step, 4), "time_ratio": round(step / base_time, 3),
                     "loss": round(losses[row], 5)}
        print(f"{row[0]:<12} {row[1]:>6} {temp / 2**20:>9.1f} {temp / base_temp:>9.3f} "
              f"{step:>8.4f} {step / base_time:>9.3f} {losses[row]:>10.5f}")
    spread = max(losses.values()) - min(losses.values())
    print(f"\nfirst-step losses agree within {spread:.2e}")
    choices = memory_model_choices()
    print(json.dumps({"benchmark": "step_memory", "vocab": args.vocab, "seq_len": args.seq_len,
                      "rows": args.rows, "logits_bytes": logits, "loss_spread": spread,
                      "settings": out, "memory_model": choices}))


if __name__ == "__main__":
    main()
