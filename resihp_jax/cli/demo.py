"""`resihp demo`: a resilient run with injected faults, end to end (the run is demo/app.py);
every flag a user can get wrong is checked here, before JAX starts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from resihp_jax.cli.args import (add_compile_cache_arguments, add_metrics_argument,
                                 check_output_dir, check_output_file,
                                 compile_cache_dir, model_from_args, parse_int_list,
                                 parse_mesh)
from resihp_jax.demo import app
from resihp_jax.demo.config import DemoConfig, check_at_least, check_plot_name, check_two_files
from resihp_jax.demo.plot import PLOT_SUFFIXES
from resihp_jax.demo.scenario import parse_kill, parse_slow
from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan
from resihp_jax.models.registry import GPT2_PLAN, MODELS, Entry, check_plan, states_facts

LLAMA_PLAN = "dp=2,pp=2,tp=2"  # a preset's (rh.models.Llama's) starting mesh


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (f"Exit status: 0 when every injected fault that affected the run was "
                     f"handled, {app.EXIT_UNDETECTED} when one was never detected (a loud WARNING "
                     "says which), 2 for a bad argument.")
    add = parser.add_argument
    add("--devices", type=int, default=None,
        help="devices in the pool, fake CPU devices when no accelerator; more than the plan "
             "needs leaves spares for re-plans (default: dp*pp*tp of --plan)")
    add("--plan", default=None,
        help=f"starting mesh (default {LLAMA_PLAN}; with --model gpt2 {GPT2_PLAN}: a "
             "user's model trains on plans with tp=1 only, where injected slowdowns reach it)")
    add("--microbatches", default=None,
        help="micro-batches per DP group, e.g. 4,4 (default: 4 per group)")
    add("--model", default="tiny", choices=sorted(MODELS),
        help="a preset of rh.models.Llama (its own tensor parallelism: slowdowns reach it "
             "at any tp), or gpt2: the GPT-2 example's own NNX model (rh.models.GPT2, "
             "examples/user_model/train_gpt2.py), a user's model; both trained through "
             "rh.fit's path (default tiny)")
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
             "steps over its warm-up (steps 1..24), where only its probe checks of every "
             "device find a slowdown, of 1.5x or more (default 5=3.0@32; 'none': no "
             "slowdown)")
    add("--kill", default="2@48", metavar="DEVICE@STEP",
        help="device DEVICE stops at STEP (fail-stop; may be the slowed device) (default 2@48; "
             "'none': no stop)")
    add("--checkpoint-dir", default=None,
        help="save orbax checkpoints here every 8 steps; a stopped device is then recovered "
             "from the latest one (default: the state moves in memory)")
    add_metrics_argument(parser, "where to write metrics: jsonl:PATH or a plain path (one "
                         "JSON object per step and per event), tensorboard:DIR (pip install "
                         "'resihp_jax[tensorboard]'), wandb:PROJECT (offline without an API "
                         "key; pip install 'resihp_jax[wandb]'); repeatable, one JSON lines "
                         "file at most")
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


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None
        ) -> int:
    out, err = out or sys.stdout, err or sys.stderr  # looked up now: tests swap them
    return app.run(demo_config(args), out, err)


def demo_config(args: argparse.Namespace) -> DemoConfig:
    """Validate every flag (pure: no JAX) into the run's DemoConfig; ConfigError/PlanError name
    the bad value. With several bad values the first check to fail is reported, so the checks
    keep the order users have seen (numbers, output files, model and plan, faults)."""
    for name in ("steps", "seq_len", "microbatch_size"):
        check_at_least(getattr(args, name), 1, f"--{name.replace('_', '-')}")
    check_at_least(args.seed, 0, "--seed")
    plot = None if args.plot.strip().lower() == "none" else args.plot
    jsonl, dashboards = _metrics(args.metrics)
    _check_outputs(args, plot, jsonl)
    model = model_from_args(args)
    plan = demo_plan(args, model)
    n_devices = plan.n_devices if args.devices is None else args.devices
    if n_devices < plan.n_devices:
        raise ConfigError(f"--devices={n_devices}: --plan {plan_text(args)} needs "
                          f"dp*pp*tp={plan.n_devices} devices")
    check_plan(model, plan, f"--plan {plan_text(args)}")
    plan.check(model, range(n_devices))
    check_at_least(args.precompile, 0, "--precompile")
    slow, kill = parse_slow(args.slow), parse_kill(args.kill)
    return DemoConfig(model, plan, n_devices, args.steps, slow=slow, kill=kill, seed=args.seed,
                      data=args.data, plot=plot, metrics=jsonl, dashboards=dashboards,
                      checkpoint_dir=args.checkpoint_dir, precompile=args.precompile,
                      background_compile=not args.no_background_compile,
                      progress=not args.no_progress, compile_cache=compile_cache_dir(args))


def _metrics(values: list[str] | None) -> tuple[str | None, tuple[str, ...]]:
    """--metrics as the demo's JSON lines file (one at most) and the other destinations."""
    from resihp_jax.metrics.destinations import parse_destinations  # noqa: PLC0415

    given = values or []
    parsed = parse_destinations(given, "--metrics")
    files = [d.target for d in parsed if d.kind == "jsonl"]
    for d in parsed:
        if d.kind == "tensorboard":
            check_output_dir(d.target, "--metrics")
    if len(files) > 1:
        raise ConfigError(f"--metrics: {len(files)} JSON lines files given; the demo writes one")
    return (files[0] if files else None,
            tuple(v for v, d in zip(given, parsed) if d.kind != "jsonl"))


def _check_outputs(args: argparse.Namespace, plot: str | None, metrics: str | None) -> None:
    check_plot_name(plot, "--plot", off="'none'")
    for flag, path in (("--plot", plot), ("--metrics", metrics)):
        check_output_file(path, flag)
    check_two_files(plot, metrics, ("--plot", "--metrics"))
    check_output_dir(args.checkpoint_dir, "--checkpoint-dir")
    if args.checkpoint_dir is not None and any(Path(args.checkpoint_dir).iterdir()):
        # the trainer would restore a stop from whatever newest step it finds there
        raise ConfigError(f"--checkpoint-dir={args.checkpoint_dir!r} is not empty; the demo "
                          "starts from scratch: give a new or empty directory")


def plan_text(args: argparse.Namespace) -> str:
    """--plan as given, else the model's default (a user's model starts at tp=1)."""
    if args.plan is not None:
        return args.plan
    return LLAMA_PLAN if states_facts(MODELS[args.model]) else GPT2_PLAN


def demo_plan(args: argparse.Namespace, model: Entry) -> Plan:
    text = plan_text(args)
    dp, pp, tp = parse_mesh(text).values()  # in that order
    per_group = (parse_int_list(args.microbatches, "--microbatches") if args.microbatches
                 else (4,) * dp)
    if len(per_group) != dp:
        raise ConfigError(f"--microbatches={args.microbatches}: {len(per_group)} group(s) given; "
                          f"--plan {text} has dp={dp}")
    plan = Plan.uniform(dp, pp, tp, n_layers=model.n_layers, n_microbatches=sum(per_group),
                        microbatch_size=args.microbatch_size, seq_len=args.seq_len)
    return plan.replace(microbatches_per_group=per_group)
