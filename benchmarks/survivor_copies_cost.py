"""What keeping the survivors' copies costs a healthy step, per mode, on any device.

Runs the same `resihp train` job (one process, same plan, seed and batches) once per
`--survivor-copies` mode, in rounds that alternate the modes, and compares the median time
of a step plus its host copy against `off` (no copy kept; the step donates its state):
- keep: the step does not donate; the last two states stay in device memory;
- host: the step donates; after it, this process's shards are copied to host memory.
No fault is injected: this is the price paid while nothing fails. The first two steps of
each run (compiling, warming up) are left out. On CPU (fake devices) the copy is a memcpy;
on an accelerator it crosses the host link, which is what this benchmark is for.

Usage: python benchmarks/survivor_copies_cost.py [--quick] [--model M] [--plan P]
       [--dtype D] [--steps N] [--rounds R] [--seq-len S] [--microbatch-size B]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from resihp_jax.models.config import PRESETS  # noqa: E402
from train_subprocess import run_train  # noqa: E402

MODES = ("off", "keep", "host")


def _run(root: Path, name: str, mode: str, args: argparse.Namespace) -> list[dict]:
    train = ["--model", args.model, "--plan", args.plan, "--steps", str(args.steps),
             "--seq-len", str(args.seq_len), "--microbatch-size", str(args.microbatch_size),
             "--data", "synthetic:lognormal", "--checkpoint-dir", str(root / name),
             "--checkpoint-every", "100000", "--survivor-copies", mode, "--no-progress",
             "--no-compile-cache"]
    if args.dtype:
        train += ["--dtype", args.dtype]
    return run_train(train, root / f"{name}.jsonl")


def _step_costs(records: list[dict]) -> list[float]:
    """Seconds of each steady step plus its host copy (the first two steps left out)."""
    return [r["step_time_s"] + r.get("host_copy_s", 0.0) for r in records if r["step"] > 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="`tiny` on 8 fake CPU devices, 1 round of 8 steps (about a minute)")
    parser.add_argument("--model", default="small", choices=sorted(PRESETS),
                        help="model preset (default small)")
    parser.add_argument("--plan", default="dp=2,pp=2,tp=2", help="mesh (default dp=2,pp=2,tp=2)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                        help="default: the preset's own")
    parser.add_argument("--steps", type=int, default=10, help="steps per run (default 10)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of every mode, alternating (default 2)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per row (default 256)")
    parser.add_argument("--microbatch-size", type=int, default=2,
                        help="rows per micro-batch (default 2)")
    parser.add_argument("--modes", default=",".join(MODES[1:]),
                        help="modes measured against off, comma-separated (default keep,host)")
    args = parser.parse_args()
    if args.quick:
        args.model, args.steps, args.rounds, args.seq_len = "tiny", 8, 1, 128
    if args.steps < 4 or args.rounds < 1:
        parser.error(f"--steps={args.steps} (>= 4) and --rounds={args.rounds} (>= 1) needed")
    asked = tuple(m for m in args.modes.split(",") if m)
    if not asked or any(m not in MODES[1:] for m in asked):
        parser.error(f"--modes={args.modes!r}: give keep, host or both, comma-separated")
    modes = ("off", *asked)
    costs: dict[str, list[float]] = {m: [] for m in modes}
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="resihp-copies-") as tmp:
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                t0 = time.perf_counter()
                records = _run(Path(tmp), f"{mode}-{r}", mode, args)
                costs[mode] += _step_costs(records)
                print(f"round {r + 1}/{args.rounds} {mode:<5} median "
                      f"{statistics.median(_step_costs(records)):.4f} s/step (run "
                      f"{time.perf_counter() - t0:.0f} s)", flush=True)
    import jax  # noqa: PLC0415 - only to name the device the runs used

    device = jax.devices()[0].device_kind
    median = {m: statistics.median(c) for m, c in costs.items()}
    print(f"\nsurvivor copies, healthy cost: {args.model} ({args.dtype or 'preset dtype'}), "
          f"plan {args.plan}, {args.microbatch_size}x{args.seq_len} tokens per micro-batch, "
          f"device {device}; no faults\n")
    print(f"{'mode':<6}{'steps':>7}{'median s/step':>15}{'vs off':>9}")
    for mode in modes:
        print(f"{mode:<6}{len(costs[mode]):>7}{median[mode]:>15.4f}"
              f"{median[mode] / median['off']:>9.3f}")
    print(f"benchmark wall time {time.perf_counter() - wall:.0f} s")
    print(json.dumps({"device": device, "model": args.model, "plan": args.plan,
                      "step_s": {m: round(v, 5) for m, v in median.items()},
                      "overhead": {m: round(median[m] / median["off"] - 1, 4)
                                   for m in asked}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
