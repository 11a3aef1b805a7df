"""`resihp train`: train a model under one Plan on real or fake devices."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

from resihp_jax.errors import ConfigError
from resihp_jax.cli_args import parse_int_list, parse_mesh
from resihp_jax.meshes.plan import Plan
from resihp_jax.model.config import PRESETS, get_model_config
from resihp_jax.runtime.devices import request_host_devices, select_devices


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=8,
                        help="devices to use; fake CPU devices when no accelerator (default 8)")
    parser.add_argument("--plan", default="dp=2,pp=2,tp=2", help="mesh, e.g. dp=2,pp=2,tp=2")
    parser.add_argument("--layers", help="layers per stage, e.g. 1,3 (default: even)")
    parser.add_argument("--microbatches", default=None,
                        help="micro-batches per DP group, e.g. 3,1 (default: 2 per group)")
    parser.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--data", default="synthetic:lognormal",
                        help="synthetic:uniform|lognormal|bimodal, corpus, or corpus:PATH")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--microbatch-size", type=int, default=2, help="rows per micro-batch")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per row")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--remat", action="store_true", help="recompute activations in backward")
    parser.add_argument("--metrics", help="write one JSON object per step to this file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def plan_from_args(args: argparse.Namespace, n_layers: int) -> Plan:
    mesh = parse_mesh(args.plan)
    dp, pp, tp = mesh["dp"], mesh["pp"], mesh["tp"]
    if args.microbatches:
        mbs = parse_int_list(args.microbatches, "--microbatches")
    else:
        mbs = (2,) * dp
    if dp * pp * tp != args.devices:
        raise ConfigError(f"--plan {args.plan} needs dp*pp*tp={dp * pp * tp} devices; "
                          f"--devices={args.devices}")
    plan = Plan.uniform(dp, pp, tp, n_layers=n_layers, n_microbatches=max(sum(mbs), dp),
                        microbatch_size=args.microbatch_size, seq_len=args.seq_len)
    changes: dict[str, object] = {"microbatches_per_group": mbs}
    if args.layers:
        changes["layers_per_stage"] = parse_int_list(args.layers, "--layers")
    return plan.replace(**changes)


def _check_args(args: argparse.Namespace) -> None:
    for name in ("steps", "microbatch_size", "seq_len"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    _check_args(args)
    request_host_devices(args.devices)
    model = get_model_config(args.model)
    plan = plan_from_args(args, model.n_layers)
    from resihp_jax.data import BatchIterator  # noqa: PLC0415 - after the device flag is set
    from resihp_jax.runtime.loop import train
    from resihp_jax.train.config import TrainConfig
    from resihp_jax.train.step import build_step
    from tqdm import tqdm

    devices = select_devices(args.devices)
    train_cfg = TrainConfig(learning_rate=args.lr, remat=args.remat,
                            microbatch_slots=max(plan.microbatches_per_group))
    data = BatchIterator(args.data, n_microbatches=plan.n_microbatches,
                         microbatch_size=plan.microbatch_size, seq_len=plan.seq_len,
                         seed=args.seed)
    program = build_step(model, train_cfg, plan, devices)
    print(f"model {model.name} ({model.param_count() / 1e6:.2f}M params), plan "
          f"{plan.describe()}, {plan.tokens_per_step} tokens/step, data {args.data}", file=out)
    state = program.init_state(args.seed)
    metrics_file = open(args.metrics, "w") if args.metrics else None  # noqa: SIM115
    bar = tqdm(total=args.steps, disable=args.no_progress, unit="step", file=sys.stderr)
    records = []
    try:
        for _, record in train(program, state, data, args.steps):
            records.append(record)
            if metrics_file:
                metrics_file.write(json.dumps(record.to_json()) + "\n")
                metrics_file.flush()
            bar.set_postfix(loss=f"{record.loss:.4f}", tok_s=f"{record.tokens_per_s:,.0f}")
            bar.update()
    finally:
        bar.close()
        if metrics_file:
            metrics_file.close()
    steady = records[1:] or records  # the first step includes compilation
    tokens_per_s = sum(r.tokens for r in steady) / sum(r.step_time_s for r in steady)
    print(f"final loss {records[-1].loss:.4f} (first {records[0].loss:.4f}); "
          f"{tokens_per_s:,.0f} tokens/s after the first (compiling) step", file=out)
    return 0
