"""What a background thread's Python costs the step loop, at the interpreter's default switch
interval (5 ms) and under the training loop's (`runtime/trainer/resilient.py`, 0.1 ms).

The loop has the shape of a training process's: each step it waits on "the device" with the
GIL released, then does its host work between steps (the record, the detector, the timing),
letting go of the GIL at each wait on a device value. The device is a GIL-free wait of
`--step-ms`: on this 2-core CPU a real XLA step and the background thread would also fight
over the cores, which hides what the lock alone does (on a GPU the device is not the host's).
The background thread traces and lowers JAX programs without pause, as precompile.py does
for the likely next plans and the layout moves. No fault is injected: this is the steady
price of background work on a healthy run.

Rows, each against the loop without a background thread in the same run:
- default: the background thread, the interpreter's 5 ms switch interval;
- responsive_loop: the background thread, the interval the training loop sets.
The last column is the background thread's pace (programs traced a second): what the short
interval costs the background work.

Usage: python benchmarks/gil_contention.py [--quick] [--steps N] [--step-ms MS]
       [--waits W] [--rounds R]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable, ContextManager

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from resihp_jax.runtime.trainer.resilient import SWITCH_INTERVAL_S, responsive_loop  # noqa: E402,E501


def _trace_forever(stop: threading.Event, traced: list[int]) -> None:
    """Trace and lower fresh programs (never cached: each closes over a new constant)."""
    while not stop.is_set():
        k = len(traced)

        def program(x: jax.Array, k: int = k) -> jax.Array:
            for i in range(100):
                x = jnp.sin(x) * (i + k)
            return x

        jax.jit(program).lower(jnp.ones((8,), jnp.float32))
        traced.append(k)


def _loop(steps: int, step_s: float, waits: int) -> list[float]:
    """Seconds from one step's end to the next's, over `steps` steps."""
    gaps: list[float] = []
    last = time.perf_counter()
    for _ in range(steps):
        time.sleep(step_s)  # the device runs the step: the GIL is free meanwhile
        for _ in range(waits):  # host work between steps, each wait lets go of the GIL
            sum(range(300))
            time.sleep(0)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    return gaps


def _timed(steps: int, step_s: float, waits: int, background: bool,
           setting: Callable[[], ContextManager[None]]) -> tuple[float, float]:
    """(median step in seconds, programs the background traced a second meanwhile)."""
    stop, traced = threading.Event(), []
    thread = threading.Thread(target=_trace_forever, args=(stop, traced), daemon=True)
    if background:
        thread.start()
        while not traced:  # the thread is under way (its first trace includes JAX's start)
            time.sleep(0.01)
    try:
        with setting():
            before = len(traced)
            gaps = _loop(steps, step_s, waits)
            rate = (len(traced) - before) / sum(gaps)
    finally:
        stop.set()
        if background:
            thread.join()
    return statistics.median(gaps), rate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 steps a run, 1 round")
    parser.add_argument("--steps", type=int, default=None, help="steps a run (default 200)")
    parser.add_argument("--step-ms", type=float, default=20.0,
                        help="the device's time a step, in ms (default 20)")
    parser.add_argument("--waits", type=int, default=10,
                        help="GIL releases of the host work a step (default 10)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="times each row runs, alternated; medians (default 3)")
    args = parser.parse_args(argv)
    steps = args.steps or (60 if args.quick else 200)
    rounds = args.rounds or (1 if args.quick else 3)
    if steps < 5 or rounds < 1 or args.step_ms <= 0 or args.waits < 0:
        parser.error(f"--steps {steps} (>= 5), --rounds {rounds} (>= 1), --step-ms "
                     f"{args.step_ms} (> 0) and --waits {args.waits} (>= 0) are out of range")
    step_s = args.step_ms / 1e3
    rows = {"none": (False, contextlib.nullcontext),
            "default": (True, contextlib.nullcontext),
            "responsive_loop": (True, responsive_loop)}
    medians: dict[str, list[float]] = {name: [] for name in rows}
    traced: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, (background, setting) in rows.items():
            median_s, n = _timed(steps, step_s, args.waits, background, setting)
            medians[name].append(median_s)
            traced[name].append(n)
    step_ms = {name: 1e3 * statistics.median(v) for name, v in medians.items()}
    ratio = {name: step_ms["none"] / step_ms[name] for name in rows}
    print(f"gil_contention: {steps} steps a run, {rounds} round(s); the device a GIL-free "
          f"wait of {args.step_ms:g} ms, {args.waits} GIL releases a step; the background "
          "thread traces and lowers JAX programs throughout (no fault injected)")
    print(f"{'background thread, switch interval':44} {'median step ms':>15} "
          f"{'throughput vs none':>19} {'traced a second':>16}")
    labels = {"none": "none", "default": f"yes, {1e3 * sys.getswitchinterval():g} ms "
              "(the interpreter's)", "responsive_loop": f"yes, {1e3 * SWITCH_INTERVAL_S:g} "
              "ms (responsive_loop)"}
    for name in rows:
        print(f"{labels[name]:44} {step_ms[name]:15.1f} {ratio[name]:19.3f} "
              f"{statistics.median(traced[name]):16.1f}")
    print(json.dumps({"benchmark": "gil_contention", "step_ms": args.step_ms,
                      "waits": args.waits, "median_step_ms": {k: round(v, 2)
                                                              for k, v in step_ms.items()},
                      "default_vs_none": round(ratio["default"], 3),
                      "responsive_loop_vs_none": round(ratio["responsive_loop"], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
