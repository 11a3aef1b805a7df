"""`resihp demo`: a resilient run on fake devices with an injected fault, end to end.

Trains under a Plan; from a chosen step one device runs slower (or stops). The detector
names it, the scheduler re-plans, the state moves, training goes on; a summary compares
throughput before the fault, while degraded, and after the re-plan.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from typing import TextIO

from resihp_jax.errors import ConfigError
from resihp_jax.model.config import PRESETS, get_model_config
from resihp_jax.runtime.devices import request_host_devices, select_devices


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--plan", default="dp=2,pp=2,tp=2")
    parser.add_argument("--microbatches", default="4,4", help="micro-batches per DP group")
    parser.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--data", default="synthetic:lognormal")
    parser.add_argument("--steps", type=int, default=56)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--slow", default="5=3.0@32",
                        help="DEVICE=FACTOR@STEP: the device runs FACTOR times slower from STEP"
                             " ('none' for a healthy run)")
    parser.add_argument("--kill", default=None, help="DEVICE@STEP: the device stops at STEP")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="checkpoint here (needed to survive --kill from a checkpoint)")
    parser.add_argument("--metrics", default=None, help="one JSON object per step/event")
    parser.add_argument("--no-progress", action="store_true")


def parse_slow(text: str | None) -> tuple[int, float, int] | None:
    if text in (None, "none"):
        return None
    match = re.fullmatch(r"(\d+)=([\d.]+)@(\d+)", text)
    if not match or float(match.group(2)) < 1:
        raise ConfigError(f"--slow={text!r}: expected DEVICE=FACTOR@STEP with FACTOR >= 1, "
                          "e.g. 5=3.0@32")
    return int(match.group(1)), float(match.group(2)), int(match.group(3))


def parse_kill(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    match = re.fullmatch(r"(\d+)@(\d+)", text)
    if not match:
        raise ConfigError(f"--kill={text!r}: expected DEVICE@STEP, e.g. 3@30")
    return int(match.group(1)), int(match.group(2))


def _phase_rate(records: list, lo: int, hi: int) -> float | None:
    times = [r.step_time_s for r in records if lo <= r.step < hi]
    if not times:
        return None
    return records[0].tokens / statistics.median(times)


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    slow, kill = parse_slow(args.slow), parse_kill(args.kill)
    request_host_devices(args.devices)
    from resihp_jax.runtime.train_cli import plan_from_args
    model = get_model_config(args.model)
    args.layers, args.lr = None, 3e-3
    plan = plan_from_args(args, model.n_layers)
    from tqdm import tqdm

    from resihp_jax.data import BatchIterator
    from resihp_jax.runtime.faults import FaultInjector
    from resihp_jax.runtime.resilient import Replan, ResilienceConfig, ResilientTrainer
    from resihp_jax.train.config import TrainConfig

    devices = select_devices(args.devices)
    plan.check(model, [d.id for d in devices])
    injector = FaultInjector(plan)
    if slow:
        injector.slow(slow[0], slow[1], start_step=slow[2])
    if kill:
        injector.kill(kill[0], at_step=kill[1])
    data = BatchIterator(args.data, n_microbatches=plan.n_microbatches,
                         microbatch_size=plan.microbatch_size, seq_len=plan.seq_len,
                         seed=args.seed)
    trainer = ResilientTrainer(model, TrainConfig(), plan, devices, data,
                               ResilienceConfig(checkpoint_dir=args.checkpoint_dir,
                                                checkpoint_interval=8),
                               fault_hook=injector)
    print(f"resihp demo: {model.name} on {args.devices} {devices[0].platform} devices, plan "
          f"{plan.describe()}; fault: {_fault_text(slow, kill)}", file=out)
    records, events = [], []
    metrics = open(args.metrics, "w") if args.metrics else None  # noqa: SIM115
    bar = tqdm(total=args.steps, disable=args.no_progress, unit="step", file=sys.stderr)
    try:
        for item in trainer.run(args.steps, seed=args.seed):
            if isinstance(item, Replan):
                events.append(item)
                bar.write(_replan_text(item, slow, kill))
                row = {"event": "replan", "step": item.step, "devices": item.verdict.devices,
                       "kind": item.verdict.kind, "slowdown": item.verdict.slowdown,
                       "new_plan": item.new_plan.to_dict(), "switch_s": item.switch_s}
            else:
                records.append(item)
                bar.set_postfix(loss=f"{item.loss:.3f}", step_s=f"{item.step_time_s:.3f}")
                bar.update()
                row = item.to_json()
            if metrics:
                metrics.write(json.dumps(row) + "\n")
    finally:
        bar.close()
        if metrics:
            metrics.close()
    _summary(records, events, slow, kill, trainer, out)
    return 0


def _fault_text(slow: tuple | None, kill: tuple | None) -> str:
    parts = []
    if slow:
        parts.append(f"device {slow[0]} {slow[1]:g}x slower from step {slow[2]}")
    if kill:
        parts.append(f"device {kill[0]} stops at step {kill[1]}")
    return ", ".join(parts) or "none (healthy run)"


def _replan_text(item, slow: tuple | None, kill: tuple | None) -> str:  # noqa: ANN001
    v = item.verdict
    onset = slow[2] if slow and v.kind != "stopped" else (kill[1] if kill else None)
    delay = f", {v.step - onset} step(s) after onset" if onset is not None else ""
    how = (f" (restored from checkpoint step {item.restored_from_step})"
           if item.restored_from_step is not None else "")
    return (f"step {v.step}: {v.detector} verdict: device(s) {list(v.devices)} {v.kind}, "
            f"~{v.slowdown:.2f}x, confidence {v.confidence:.2f}{delay}\n"
            f"    re-plan: {item.old_plan.describe()} -> {item.new_plan.describe()} "
            f"in {item.switch_s:.1f} s{how}\n    why: {item.reason}")


def _summary(records: list, events: list, slow: tuple | None, kill: tuple | None,
             trainer, out: TextIO) -> None:  # noqa: ANN001
    onset = slow[2] if slow else (kill[1] if kill else None)
    replan_step = events[0].step if events else None
    phases = [("healthy", 2, onset or 10**9)]
    if onset is not None:
        phases.append(("degraded", onset, replan_step + 1 if replan_step else 10**9))
    if replan_step is not None:
        phases.append(("re-planned", replan_step + 2, 10**9))  # +2: skip the recompile step
    print(f"\n{'phase':<12}{'tokens/s':>12}", file=out)
    rates = {}
    for name, lo, hi in phases:
        rate = _phase_rate(records, lo, hi)
        rates[name] = rate
        print(f"{name:<12}{rate if rate is None else round(rate):>12}", file=out)
    print(f"false alarms / probes: {trainer.detector.alarms - len(events)} of "
          f"{trainer.detector.alarms} alarm(s)", file=out)
    print(f"final loss {records[-1].loss:.4f} after {records[-1].step} steps "
          f"(first {records[0].loss:.4f}); final plan {trainer.plan.describe()}", file=out)
