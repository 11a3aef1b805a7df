"""`resihp demo`: a resilient run with injected faults, end to end.

Trains under a Plan on the local text corpus; from chosen steps one device runs slower and
another stops. The detector names them, the scheduler re-plans, the state moves, training
goes on. Ends with a summary (tokens/s before each fault, while degraded and after each
re-plan; detection delays; false alarms; steps lost) and a timeline figure. Every input a
user can get wrong is checked before JAX starts.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from resihp_jax.cli.args import (add_compile_cache_arguments, check_output_dir, check_output_file,
                                 compile_cache_dir, parse_int_list, parse_mesh)
from resihp_jax.errors import ConfigError
from resihp_jax.meshes.plan import Plan
from resihp_jax.model.config import PRESETS, ModelConfig, get_model_config
from resihp_jax.demo.scenario import (Fault, KillSpec, SlowSpec, check_faults,
                                            check_kill_survivable, parse_kill, parse_slow)
from resihp_jax.demo.plot import PLOT_SUFFIXES
from resihp_jax.demo.summary import match_faults, write_summary

DEVICE_MEMORY_GB = 4.0  # what the trainer's scheduler assumes per fake device
EXIT_UNDETECTED = 1  # an injected fault slowed the run and was never detected


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (f"Exit status: 0 when every injected fault that affected the run was "
                     f"handled, {EXIT_UNDETECTED} when one was never detected (a loud WARNING "
                     "says which), 2 for a bad argument.")
    add = parser.add_argument
    add("--devices", type=int, default=None,
        help="devices in the pool, fake CPU devices when no accelerator; more than the plan "
             "needs leaves spares for re-plans (default: dp*pp*tp of --plan)")
    add("--plan", default="dp=2,pp=2,tp=2", help="starting mesh (default dp=2,pp=2,tp=2)")
    add("--microbatches", default=None,
        help="micro-batches per DP group, e.g. 4,4 (default: 4 per group)")
    add("--model", default="tiny", choices=sorted(PRESETS), help="model preset (default tiny)")
    add("--dtype", default=None, choices=("float32", "bfloat16"),
        help="parameter and compute dtype (default: the preset's)")
    add("--data", default="corpus",
        help="corpus (the Python standard library's sources), corpus:PATH, or "
             "synthetic:uniform|lognormal|bimodal (default corpus)")
    add("--steps", type=int, default=64, help="training steps (default 64)")
    add("--seed", type=int, default=0, help="seed of the parameters and the data order")
    add("--seq-len", type=int, default=256, help="tokens per row (default 256)")
    add("--microbatch-size", type=int, default=2, help="rows per micro-batch (default 2)")
    add("--slow", default="5=3.0@32", metavar="DEVICE=FACTOR@STEP",
        help="device DEVICE runs FACTOR times slower from STEP on; the detector learns healthy "
             "steps first, so STEP must be after its warm-up (default 5=3.0@32; 'none': no "
             "slowdown)")
    add("--kill", default="2@48", metavar="DEVICE@STEP",
        help="device DEVICE stops at STEP (fail-stop; may be the slowed device) (default 2@48; "
             "'none': no stop)")
    add("--checkpoint-dir", default=None,
        help="save orbax checkpoints here every 8 steps; a stopped device is then recovered "
             "from the latest one (default: the state moves in memory)")
    add("--metrics", default=None, help="write one JSON object per step and per event here")
    add("--plot", default="resihp-demo.png",
        help=f"save the timeline figure here ({', '.join(PLOT_SUFFIXES)}; default "
             "resihp-demo.png; 'none': no figure)")
    add("--no-progress", action="store_true",
        help="no progress output (default: a bar on a terminal, else a line every few steps)")
    add("--precompile", type=int, default=4, metavar="N",
        help="compile, in the background while training, the programs of up to N plans the "
             "scheduler would pick after a likely next fault, so switching to one compiles "
             "nothing (default 4; 0: off)")
    add("--no-background-compile", action="store_true",
        help="when a slow device calls for a new mesh, stall and compile it at once (default: "
             "train a split of the current mesh while it compiles in the background)")
    add_compile_cache_arguments(parser)


@dataclass(frozen=True)
class Setup:
    """Everything the flags decide, checked, before JAX starts."""
    model: ModelConfig
    plan: Plan
    n_devices: int
    slow: SlowSpec | None
    kill: KillSpec | None
    plot: str | None
    compile_cache: str | None = None  # the persistent compilation cache (None: off)

    @property
    def faults(self) -> list[Fault]:
        return [f for f in (self.slow, self.kill) if f is not None]


def check_args(args: argparse.Namespace) -> Setup:
    """Validate every flag (pure: no JAX); ConfigError/PlanError name the bad value."""
    for name in ("steps", "seq_len", "microbatch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.seed < 0:
        raise ConfigError(f"--seed={args.seed}: must be >= 0")
    plot = None if args.plot.strip().lower() == "none" else args.plot
    if plot is not None and not plot.lower().endswith(PLOT_SUFFIXES):
        raise ConfigError(f"--plot={plot!r}: the file name must end in "
                          f"{', '.join(PLOT_SUFFIXES)} (or give 'none')")
    for flag, path in (("--plot", plot), ("--metrics", args.metrics)):
        check_output_file(path, flag)
    if plot is not None and args.metrics is not None and \
            Path(plot).absolute() == Path(args.metrics).absolute():
        raise ConfigError(f"--plot and --metrics are both {plot!r}: give two files")
    check_output_dir(args.checkpoint_dir, "--checkpoint-dir")
    if args.checkpoint_dir is not None and any(Path(args.checkpoint_dir).iterdir()):
        # the trainer would restore a stop from whatever newest step it finds there
        raise ConfigError(f"--checkpoint-dir={args.checkpoint_dir!r} is not empty; the demo "
                          "starts from scratch: give a new or empty directory")
    model = get_model_config(args.model, dtype=args.dtype) if args.dtype else \
        get_model_config(args.model)
    plan = demo_plan(args, model)
    n_devices = plan.n_devices if args.devices is None else args.devices
    if n_devices < plan.n_devices:
        raise ConfigError(f"--devices={n_devices}: --plan {args.plan} needs "
                          f"dp*pp*tp={plan.n_devices} devices")
    plan.check(model, range(n_devices))
    if args.precompile < 0:
        raise ConfigError(f"--precompile={args.precompile}: must be >= 0")
    return Setup(model, plan, n_devices, parse_slow(args.slow), parse_kill(args.kill), plot,
                 compile_cache_dir(args))


def demo_plan(args: argparse.Namespace, model: ModelConfig) -> Plan:
    mesh = parse_mesh(args.plan)
    dp, pp, tp = mesh["dp"], mesh["pp"], mesh["tp"]
    per_group = (parse_int_list(args.microbatches, "--microbatches") if args.microbatches
                 else (4,) * dp)
    if len(per_group) != dp:
        raise ConfigError(f"--microbatches={args.microbatches}: {len(per_group)} group(s) given; "
                          f"--plan {args.plan} has dp={dp}")
    plan = Plan.uniform(dp, pp, tp, n_layers=model.n_layers, n_microbatches=sum(per_group),
                        microbatch_size=args.microbatch_size, seq_len=args.seq_len)
    return plan.replace(microbatches_per_group=per_group)


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None
        ) -> int:
    out, err = out or sys.stdout, err or sys.stderr  # looked up now: tests swap them
    setup = check_args(args)
    from resihp_jax.runtime.job.devices import request_host_devices

    request_host_devices(setup.n_devices)  # before anything imports JAX
    from resihp_jax.detector.ours import WARMUP_STEPS

    warnings = check_faults(setup.slow, setup.kill, steps=args.steps,
                            plan_devices=setup.plan.device_ids, warmup=WARMUP_STEPS)
    check_kill_survivable(setup.kill, setup.plan, setup.model, range(setup.n_devices),
                          DEVICE_MEMORY_GB)
    from resihp_jax.data import BatchIterator

    data = BatchIterator(args.data, n_microbatches=setup.plan.n_microbatches,
                         microbatch_size=setup.plan.microbatch_size,
                         seq_len=setup.plan.seq_len, seed=args.seed)
    for line in warnings:
        print(f"resihp demo: warning: {line}", file=err)
    from resihp_jax.demo.loop import run_demo

    log = run_demo(setup, args, data, out, err)
    if log.error is not None:  # say what happened up to the error, then report it
        write_summary(match_faults(setup.faults, log.points, log.replans), log.points,
                      log.replans, log.alarms, out)
        raise log.error
    outcomes = match_faults(setup.faults, log.points, log.replans)
    missed = write_summary(outcomes, log.points, log.replans, log.alarms, out)
    if log.metrics is not None:
        _write_outcomes(log.metrics, outcomes)
    if setup.plot is not None and log.points:
        from resihp_jax.demo.plot import save_timeline

        save_timeline(log.points, log.replans, setup.faults, setup.plot,
                      f"resihp demo: {setup.model.name}, faults: "
                      f"{'; '.join(f.describe() for f in setup.faults) or 'none'}")
        print(f"timeline: {setup.plot}", file=out)
    if log.interrupted:
        return 130
    return EXIT_UNDETECTED if missed else 0


def _write_outcomes(path: str, outcomes: list) -> None:
    with open(path, "a") as f:
        for o in outcomes:
            row: dict[str, Any] = {"event": "fault", "fault": o.fault.describe(),
                                   "onset": o.fault.step, "status": o.status,
                                   "delay_steps": o.delay, "tokens_per_s_before": o.before,
                                   "tokens_per_s_degraded": o.degraded,
                                   "tokens_per_s_after": o.after,
                                   "steps_lost": None if o.replan is None
                                   else o.replan.steps_lost}
            f.write(json.dumps(row) + "\n")

