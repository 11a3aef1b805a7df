"""`resihp simulate`: a week (or any span) of failures at cluster scale, every peer policy on
the same seeded traces. Pure numpy (no JAX import)."""

from __future__ import annotations

import argparse
import json
import sys

from resihp_jax.sim.events import POLICIES
from resihp_jax.sim.traces import SCENARIOS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--gpus", type=int, required=True, help="GPUs in the cluster (>= 64), e.g. 16384")
    add("--days", type=float, default=7.0, help="simulated days (default 7)")
    add("--scenario", required=True, choices=SCENARIOS,
        help="llama3: Llama 3's fail-stop rate; harsh: a fail-stop every 30 min; failslow: a "
        "fail-slow episode every 30 min; mixed: llama3 fail-stops plus failslow episodes")
    add("--seeds", type=int, default=5, help="seeded traces to average over (default 5)")
    add("--policies", default=",".join(POLICIES),
        help=f"comma-separated subset of: {', '.join(POLICIES)} (default: all)")
    add("--json", action="store_true", help="print only the JSON result")
    add("--plot", default=None, metavar="FILE",
        help="write a PNG of each policy's throughput over time (seed 0) to FILE")
    add("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from resihp_jax.sim.plot import check_plot_path, save_plot
    from resihp_jax.sim.report import table
    from resihp_jax.sim.study import StudyConfig, run_study, summary

    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    config = StudyConfig(args.gpus, args.scenario, args.days, args.seeds, policies)
    if args.plot:
        check_plot_path(args.plot)
    show = not args.no_progress and sys.stderr.isatty()
    with tqdm(total=config.seeds * len(policies), desc="simulate", unit="run",
              disable=not show, file=sys.stderr) as bar:
        study = run_study(config, tick=bar.update)
    if args.plot:
        save_plot(study, args.plot)
    if args.json:
        print(json.dumps({"gpus": config.n_gpus, "scenario": config.scenario,
                          "days": config.days, "seeds": config.seeds,
                          "policies": summary(study)}))
    else:
        print(table(study))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0
