"""`resihp train`: train a model under one Plan on real or fake devices, with checkpoints.

`--checkpoint-dir DIR` saves every `--checkpoint-every` steps and after the last step
(asynchronously, with orbax); `--resume` continues from the newest good checkpoint in DIR
with the same data position, onto any plan. `--steps` counts from the start of the run, so
`--steps 6 --resume` after a run of 3 trains steps 4 to 6. `--resume` on a directory with no
checkpoint yet starts from step 0 (a requeued cluster job runs the same command again).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any, TextIO

from resihp_jax.cli_args import (add_compile_cache_arguments, compile_cache_dir,
                                 parse_int_list, parse_mesh)
from resihp_jax.errors import CheckpointFallbackWarning
from resihp_jax.meshes.plan import Plan
from resihp_jax.model.config import PRESETS, get_model_config
from resihp_jax.runtime.devices import devices_to_request, request_host_devices, select_devices
from resihp_jax.runtime.quiet import orbax_read_noise_silenced
from resihp_jax.runtime.train_checks import (DEFAULT_CHECKPOINT_EVERY, check_train_args,
                                             checkpoint_interval)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=None,
                        help="devices to start (default: what the plan needs, dp*pp*tp); with "
                             "more, the plan uses the first ones; fake CPU devices when no "
                             "accelerator")
    parser.add_argument("--plan", default="dp=2,pp=2,tp=2", help="mesh, e.g. dp=2,pp=2,tp=2")
    parser.add_argument("--layers", help="layers per stage, e.g. 1,3 (default: even)")
    parser.add_argument("--microbatches", default=None,
                        help="micro-batches per DP group, e.g. 3,1 (default: 2 per group)")
    parser.add_argument("--model", default="tiny", choices=sorted(PRESETS),
                        help="model preset (default tiny)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="parameter and compute dtype (default: the preset's own)")
    parser.add_argument("--data", default="synthetic:lognormal",
                        help="synthetic:uniform|lognormal|bimodal, corpus, or corpus:PATH")
    parser.add_argument("--steps", type=int, default=20,
                        help="train until this step, counted from the start of the run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    parser.add_argument("--microbatch-size", type=int, default=2, help="rows per micro-batch")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per row")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--remat", action="store_true", help="recompute activations in backward")
    parser.add_argument("--metrics", help="write one JSON object per step to this file "
                                          "(appended to when resuming from a checkpoint)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save checkpoints here (orbax, asynchronous); it must hold no "
                             "checkpoints unless --resume is given")
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help=f"save every N steps (default {DEFAULT_CHECKPOINT_EVERY}); the "
                             "last step is always saved")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest good checkpoint in --checkpoint-dir "
                             "(any plan; model, optimizer, data and batch shape must match); "
                             "with none there yet, start from step 0")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_compile_cache_arguments(parser)


def plan_from_args(args: argparse.Namespace, n_layers: int) -> Plan:
    mesh = parse_mesh(args.plan)
    dp, pp, tp = mesh["dp"], mesh["pp"], mesh["tp"]
    if args.microbatches:
        mbs = parse_int_list(args.microbatches, "--microbatches")
    else:
        mbs = (2,) * dp
    plan = Plan.uniform(dp, pp, tp, n_layers=n_layers, n_microbatches=max(sum(mbs), dp),
                        microbatch_size=args.microbatch_size, seq_len=args.seq_len)
    changes: dict[str, object] = {"microbatches_per_group": mbs}
    if args.layers:
        changes["layers_per_stage"] = parse_int_list(args.layers, "--layers")
    return plan.replace(**changes)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout  # looked up per call, so a redirected stdout is honoured
    check_train_args(args)
    cache = compile_cache_dir(args)
    mesh = parse_mesh(args.plan)
    needed = mesh["dp"] * mesh["pp"] * mesh["tp"]
    request_host_devices(devices_to_request(args.devices, needed, args.plan))
    original_showwarning = warnings.showwarning

    def one_line(message: Any, category: type, *rest: Any, **kw: Any) -> None:
        if issubclass(category, CheckpointFallbackWarning):
            print(f"resihp train: warning: {message}", file=sys.stderr)
        else:
            original_showwarning(message, category, *rest, **kw)

    with orbax_read_noise_silenced(), warnings.catch_warnings():
        warnings.simplefilter("always", CheckpointFallbackWarning)
        warnings.showwarning = one_line  # catch_warnings puts the original back
        return _train(args, needed, cache, out)


def _train(args: argparse.Namespace, needed: int, cache: str | None, out: TextIO) -> int:
    from resihp_jax.data import BatchIterator  # noqa: PLC0415 - after the device flag is set
    from resihp_jax.runtime.compile_cache import enable_compilation_cache

    enable_compilation_cache(cache)
    from resihp_jax.runtime.checkpoint import Checkpointer
    from resihp_jax.runtime.loop import train
    from resihp_jax.runtime.run_identity import run_identity
    from resihp_jax.train.config import TrainConfig
    from resihp_jax.train.step import build_step

    model = get_model_config(args.model, **({"dtype": args.dtype} if args.dtype else {}))
    plan = plan_from_args(args, model.n_layers)
    train_cfg = TrainConfig(learning_rate=args.lr, remat=args.remat,
                            microbatch_slots=max(plan.microbatches_per_group))
    data = BatchIterator(args.data, n_microbatches=plan.n_microbatches,
                         microbatch_size=plan.microbatch_size, seq_len=plan.seq_len,
                         seed=args.seed)
    ckpt = None
    if args.checkpoint_dir is not None:
        ckpt = Checkpointer(args.checkpoint_dir, interval=checkpoint_interval(args),
                            asynchronous=True,
                            identity=run_identity(model, train_cfg, data.state()))
    devices = select_devices(args.devices or needed)
    if len(devices) > needed:
        print(f"using the first {needed} of the {len(devices)} devices for plan {args.plan}",
              file=out)
    program = build_step(model, train_cfg, plan, devices[:needed])
    print(f"model {model.name} ({model.param_count() / 1e6:.2f}M params, {model.dtype}), plan "
          f"{plan.describe()}, {plan.tokens_per_step} tokens/step, data {args.data}", file=out)
    try:
        state, start = _initial_state(args, program, data, ckpt, out)
        if start >= args.steps:
            print(f"step {start} already reaches --steps {args.steps}: nothing to train",
                  file=out)
            return 0
        records = _run_steps(args, program, state, data, ckpt, start, train)
    finally:
        if ckpt is not None:
            ckpt.wait()  # a pending save completes (or reports its failure) before exit
            ckpt.close()
    _report(records, out)
    return 0


def _initial_state(args: argparse.Namespace, program: Any, data: Any, ckpt: Any,
                   out: TextIO) -> tuple[Any, int]:
    """(state, step): the newest good checkpoint's with `--resume`, else a fresh one."""
    if args.resume and ckpt.latest_step() is not None:
        restored = ckpt.restore(program)
        data.restore(restored.data_state)
        print(f"resumed from checkpoint step {restored.step} in {ckpt.directory} "
              f"(written under plan {restored.plan.describe()})", file=out)
        return restored.state, restored.step
    if args.resume:
        print(f"no checkpoint in {ckpt.directory} yet: starting from step 0", file=out)
    return program.init_state(args.seed), 0


def _run_steps(args: argparse.Namespace, program: Any, state: Any, data: Any, ckpt: Any,
               start: int, train: Any) -> list:
    """Train from step `start` to `--steps`, writing metrics (and checkpoints)."""
    from tqdm import tqdm  # noqa: PLC0415

    bar = tqdm(total=args.steps, initial=start, disable=args.no_progress, unit="step",
               file=sys.stderr)
    # a resumed run continues the metrics of the run it resumes
    metrics_file = open(args.metrics, "a" if start else "w") if args.metrics else None  # noqa: SIM115
    records = []
    try:
        for _, record in train(program, state, data, args.steps - start, ckpt):
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
    return records


def _report(records: list, out: TextIO) -> None:
    steady = records[1:] or records  # the first step includes compilation
    tokens_per_s = sum(r.tokens for r in steady) / sum(r.step_time_s for r in steady)
    print(f"final loss {records[-1].loss:.4f} (first {records[0].loss:.4f}); "
          f"{tokens_per_s:,.0f} tokens/s after the first (compiling) step", file=out)
