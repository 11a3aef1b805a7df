"""`resihp plan`: the next plan for a health map, with every baseline's, from the command line.

Pure numpy (no JAX import), so planning a 16k-device cluster answers in seconds on a laptop.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from resihp_jax.errors import PlanError
from resihp_jax.cli.args import parse_mesh
from resihp_jax.plan import Plan
from resihp_jax.models.config import ModelConfig
from resihp_jax.models.registry import planned_model
from resihp_jax.perfmodel import CostParams, Health
from resihp_jax.perfmodel.costs import REMAT_POLICIES
from resihp_jax.scheduler.context import PlanningContext, SwitchCosts
from resihp_jax.perfmodel.health_spec import build_health, parse_dead, parse_slowdowns
from resihp_jax.scheduler.policies import BASELINES, OURS, Outcome, compare

MICROBATCHES_PER_STAGE_AND_GROUP = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--devices", type=int, default=None,
        help="devices in the cluster, ids 0..N-1 (default: the plan's dp*pp*tp)")
    add("--plan", required=True, help="current mesh, e.g. tp=4,dp=4,pp=16")
    add("--layers", type=int, default=None, help="model layers (default: the preset's)")
    add("--model", default="llama2-70b",
        help="a model of the registry that states its facts: a preset of rh.models.Llama "
             "(default: llama2-70b)")
    add("--device-memory-gb", type=float, default=80.0, help="memory per device in GB")
    add("--slow", action="append", default=[], metavar="DEV=X",
        help="device DEV computes X times slower (repeatable; e.g. 17=2.0)")
    add("--slow-link", action="append", default=[], metavar="DEV=X",
        help="device DEV's links are X times slower (repeatable)")
    add("--dead", action="append", default=[], metavar="DEV", help="dead device (repeatable)")
    add("--microbatches", type=int, default=None,
        help=f"global micro-batches per step (default: {MICROBATCHES_PER_STAGE_AND_GROUP}*pp*dp)")
    add("--microbatch-size", type=int, default=1, help="rows per micro-batch (default 1)")
    add("--seq-len", type=int, default=4096, help="tokens per row (default 4096)")
    add("--schedule", default="gpipe", choices=("gpipe", "1f1b"),
        help="pipeline schedule (default gpipe, what the train step runs)")
    # the policies of `resihp train --remat` but "auto", which picks by the compiled step's
    # memory: a plan is admitted here as under "full", the least memory's policy
    add("--remat", nargs="?", const="full", default="full", choices=REMAT_POLICIES,
        help="what the backward recomputes: none, projections or full (default, and "
             "--remat alone)")
    add("--no-remat", dest="remat", action="store_const", const="none",
        help="the same as --remat none")
    add("--device-tflops", type=float, default=300.0, help="peak TFLOP/s per device")
    add("--mfu", type=float, default=0.5, help="achieved fraction of peak FLOP/s")
    add("--recompile-s", type=float, default=SwitchCosts.recompile_s,
        help="seconds to recompile for a new mesh")
    add("--mtbf-hours", type=float, default=SwitchCosts.device_mtbf_hours,
        help="mean time between failures of one device, in hours")
    add("--json", action="store_true", help="print only the JSON result")


def build_inputs(args: argparse.Namespace) -> tuple[Plan, Health, PlanningContext]:
    """The current plan, the health map and the planning context the flags describe."""
    model = _model(args)
    dp, pp, tp = parse_mesh(args.plan).values()  # in that order
    n_devices = dp * pp * tp if args.devices is None else args.devices
    if n_devices < dp * pp * tp:
        raise PlanError(f"--plan {args.plan} needs {dp * pp * tp} devices but --devices is "
                        f"{n_devices}")
    n_mb = args.microbatches or MICROBATCHES_PER_STAGE_AND_GROUP * pp * dp
    current = Plan.uniform(dp, pp, tp, n_layers=model.n_layers, n_microbatches=n_mb,
                           microbatch_size=args.microbatch_size, seq_len=args.seq_len)
    current.check(model)
    pool = tuple(range(n_devices))
    health = build_health(pool, slow=parse_slowdowns(args.slow),
                          slow_link=parse_slowdowns(args.slow_link, "--slow-link"),
                          dead=parse_dead(args.dead))
    costs = CostParams.for_model(model, device_flops=args.device_tflops * 1e12, mfu=args.mfu)
    switch = SwitchCosts(recompile_s=args.recompile_s, device_mtbf_hours=args.mtbf_hours)
    ctx = PlanningContext(model, costs, args.device_memory_gb * 1e9, pool,
                          schedule=args.schedule, remat=args.remat, switch=switch)
    return current, health, ctx


def _model(args: argparse.Namespace) -> ModelConfig:
    if args.layers is None:
        return planned_model(args.model)
    if args.layers < 1:
        raise PlanError(f"--layers {args.layers}: must be >= 1")
    return planned_model(args.model, n_layers=args.layers)


def run(args: argparse.Namespace) -> int:
    current, health, ctx = build_inputs(args)
    outcomes = compare(current, health, ctx, (OURS,) + BASELINES)
    if args.json:
        print(json.dumps(to_json(outcomes)))
    else:
        print(render(current, health, ctx, outcomes))
    return 0


def to_json(outcomes: dict[str, Outcome]) -> dict[str, Any]:
    return {"ours": outcomes[OURS].summary(),
            "baselines": {name: o.summary() for name, o in outcomes.items() if name != OURS},
            "planning_time_s": outcomes[OURS].planning_time_s}


def render(current: Plan, health: Health, ctx: PlanningContext,
           outcomes: dict[str, Outcome]) -> str:
    ours = outcomes[OURS]
    capacity = health.capacity(ctx.pool) / len(ctx.pool)
    faults = (f"{len(health.dead)} dead, {len(health.compute)} slow compute, "
              f"{len(health.link)} slow link")
    lines = [f"current plan:  {current.describe()}",
             f"health:        {faults}; capacity {capacity:.4f} of {len(ctx.pool)} devices",
             f"chosen plan:   {ours.plan.describe() if ours.plan else 'none'}",
             f"why:           {ours.reason}",
             "",
             f"{'policy':<14}{'of healthy':>11}{'of bound':>10}  plan"]
    for name, o in outcomes.items():
        shown = "ours" if name == OURS else name
        plan = f"dp={o.plan.dp},pp={o.plan.pp},tp={o.plan.tp}" if o.plan else "cannot run"
        lines.append(f"{shown:<14}{o.fraction_of_healthy:>11.3f}"
                     f"{o.fraction_of_capacity_bound:>10.3f}  {plan}")
    lines += ["", f"planning time: {ours.planning_time_s:.3f} s"]
    return "\n".join(lines)
