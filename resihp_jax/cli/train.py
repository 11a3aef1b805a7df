"""`resihp train`: train a model under one Plan on real or fake devices, with checkpoints.

`--checkpoint-dir DIR` saves every `--checkpoint-every` steps and after the last step
(asynchronously, with orbax); `--resume` continues from the newest good checkpoint in DIR
with the same data position, onto any plan. `--steps` counts from the start of the run, so
`--steps 6 --resume` after a run of 3 trains steps 4 to 6. `--resume` on a directory with no
checkpoint yet starts from step 0 (a requeued cluster job runs the same command again).

The same command is one process of a multi-controller job (see distributed.py): every
process runs it, joins the job, reads the job's health record beside the checkpoints, and
trains on the devices the record leaves usable, with the requested plan when they allow it
and the scheduler's plan when they do not (a relaunch on the survivors). Each step runs
under a deadline from the cost model (deadline.py); a step past it ends the process with
exit code 75 so the job restarts instead of hanging.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any, TextIO

from resihp_jax.cli.args import (add_compile_cache_arguments, compile_cache_dir,
                                 parse_int_list, parse_mesh)
from resihp_jax.errors import CheckpointFallbackWarning, ResihpError
from resihp_jax.meshes.plan import Plan
from resihp_jax.model.config import PRESETS, get_model_config
from resihp_jax.errors import ConfigError
from resihp_jax.runtime.job import distributed
from resihp_jax.runtime.job.deadline import Ladder
from resihp_jax.runtime.job.devices import devices_to_request, request_host_devices, select_devices
from resihp_jax.runtime.recovery.quiet import orbax_read_noise_silenced
from resihp_jax.cli.train_checks import (DEFAULT_CHECKPOINT_EVERY, check_train_args,
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
    parser.add_argument("--survivor-copies", choices=("auto", "keep", "host", "off"),
                        default="auto",
                        help="with --checkpoint-dir, every process keeps the state of the last "
                             "completed step and writes its shards out when the job fails or "
                             "gets SIGTERM, so a relaunch rebuilds that step from the survivors "
                             "instead of going back to the periodic checkpoint. keep: the step "
                             "does not donate the state, which stays on the devices (no time, "
                             "two more states in device memory); host: a copy to host memory "
                             "after every step (stalls the devices for the copy); off: none. "
                             "auto (default): keep where two more states fit in device "
                             "memory, else host")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--adapt", action="store_true",
                        help="watch every step and re-plan around slow devices in place "
                             "(detector and scheduler; in a job of several processes, every "
                             "process follows process 0's verdict and plan)")
    parser.add_argument("--precompile", type=int, default=0,
                        help="with --adapt: compile this many likely next plans in the "
                             "background (default 0; worth it on hosts with spare cores)")
    parser.add_argument("--no-background-compile", action="store_true",
                        help="with --adapt: when a slow device calls for a new mesh, stall and "
                             "compile it at once (default: train a split of the current mesh "
                             "while it compiles in the background)")
    parser.add_argument("--hang-floor-s", type=float, default=10.0,
                        help="a step counts as hung after 3x its predicted healthy time, but "
                             "never before this many seconds (default 10)")
    parser.add_argument("--step-timeout-s", type=float, default=120.0,
                        help="a step's deadline before the cost model can predict one, "
                             "compilation included (default 120)")
    add_compile_cache_arguments(parser)
    distributed.add_arguments(parser)


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
    spec = distributed.spec_from_args(args)
    ladder = Ladder(floor_s=args.hang_floor_s, startup_s=args.step_timeout_s)
    cache = compile_cache_dir(args)
    mesh = parse_mesh(args.plan)
    needed = mesh["dp"] * mesh["pp"] * mesh["tp"]
    if spec.single:
        request_host_devices(devices_to_request(args.devices, needed, args.plan))
    elif args.devices is not None:
        raise ConfigError(f"--devices={args.devices}: in a job of several processes each "
                          "process uses the devices it was given; remove --devices")
    original_showwarning = warnings.showwarning

    def one_line(message: Any, category: type, *rest: Any, **kw: Any) -> None:
        if issubclass(category, CheckpointFallbackWarning):
            print(f"resihp train: warning: {message}", file=sys.stderr)
        else:
            original_showwarning(message, category, *rest, **kw)

    with orbax_read_noise_silenced(), warnings.catch_warnings():
        warnings.simplefilter("always", CheckpointFallbackWarning)
        warnings.showwarning = one_line  # catch_warnings puts the original back
        if spec.single:
            return _train(args, spec, ladder, needed, cache, out)
        return _as_job_process(lambda: _train(args, spec, ladder, needed, cache, out))


def _as_job_process(body: Any) -> int:
    """Run `body` as one process of a job: on any error, report it and leave at once.

    A normal interpreter exit would wait on JAX's distributed shutdown barrier, which the
    peers of a failed process never reach: the job would hang instead of restarting.
    """
    import os  # noqa: PLC0415
    import traceback  # noqa: PLC0415

    from resihp_jax.errors import HostsLeftOut, JobStepFailed  # noqa: PLC0415
    from resihp_jax.runtime.job.watchdog import HUNG_EXIT  # noqa: PLC0415

    # a process may be killed at any moment: what it printed must already be in its log
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    try:
        return body()
    except ResihpError as err:
        print(f"resihp train: error: {err}", file=sys.stderr, flush=True)
        code = 2
    except JobStepFailed as err:
        print(f"resihp train: {err}; exiting so the job restarts", file=sys.stderr, flush=True)
        code = HUNG_EXIT
    except HostsLeftOut as err:
        import jax  # noqa: PLC0415

        print(f"resihp train: {err}", file=sys.stderr, flush=True)
        code = (err.LEFT_OUT_EXIT if jax.process_index() in err.processes
                else err.REPLAN_EXIT)
    except BaseException:  # noqa: BLE001 - any crash must end the process, not hang it
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    os._exit(code)


def _train(args: argparse.Namespace, spec: distributed.JobSpec, ladder: Ladder, needed: int,
           cache: str | None, out: TextIO) -> int:
    import time  # noqa: PLC0415

    t0 = time.perf_counter()
    from resihp_jax.runtime.job.join import join  # noqa: PLC0415 - JAX starts here

    job = join(spec, ladder, args.checkpoint_dir)
    phases = {"init_s": time.perf_counter() - t0}
    from resihp_jax.data import BatchIterator  # noqa: PLC0415 - after the device flag is set
    from resihp_jax.runtime.trainer.compile_cache import enable_compilation_cache

    enable_compilation_cache(cache)
    from resihp_jax.runtime.recovery.checkpoint import Checkpointer
    from resihp_jax.runtime.recovery.run_identity import run_identity
    from resihp_jax.train.config import TrainConfig

    model = get_model_config(args.model, **({"dtype": args.dtype} if args.dtype else {}))
    t0 = time.perf_counter()
    plan = _job_plan(args, job, model, needed, out)
    phases["plan_s"] = time.perf_counter() - t0
    args.copies_mode = _copies_mode(args, plan, model)
    train_cfg = TrainConfig(learning_rate=args.lr, remat=args.remat,
                            microbatch_slots=max(plan.microbatches_per_group),
                            donate_state=args.copies_mode != "keep")
    data = BatchIterator(args.data, n_microbatches=plan.n_microbatches,
                         microbatch_size=plan.microbatch_size, seq_len=plan.seq_len,
                         seed=args.seed)
    ckpt = None
    if args.checkpoint_dir is not None and not args.adapt:  # the trainer keeps its own
        ckpt = Checkpointer(args.checkpoint_dir, interval=checkpoint_interval(args),
                            asynchronous=True,
                            identity=run_identity(model, train_cfg, data.state()))
    print(f"model {model.name} ({model.param_count() / 1e6:.2f}M params, {model.dtype}), plan "
          f"{plan.describe()}, {plan.tokens_per_step} tokens/step, data {args.data}", file=out)
    if not job.spec.single:
        print(data_share(plan), file=out)
    if args.copies_mode is not None:
        print(f"survivor copies: {args.copies_mode}"
              f"{' (auto)' if args.survivor_copies == 'auto' else ''}", file=out)
    if args.adapt:
        from resihp_jax.runtime.run.adapt import AdaptRun  # noqa: PLC0415

        run: Any = AdaptRun(args, job, model, train_cfg, plan, data, ladder, phases, cache,
                            out)
    else:
        from resihp_jax.runtime.run.plain import TrainRun  # noqa: PLC0415

        run = TrainRun(args, job, model, train_cfg, plan, data, ckpt, ladder, phases, out)
    try:
        records = run.run()
    except ResihpError:
        raise  # refused input or a diverged run: a relaunch would not do better from a copy
    except BaseException:
        from resihp_jax.runtime.recovery.host_snapshot import dump_active  # noqa: PLC0415

        # a peer died (a collective failed) or this process must stop: the relaunch
        # rebuilds the last completed step from the copies the processes left write now
        dump_active("training stopped by an error")
        raise
    finally:
        run.close()
    if records:
        _report(records, out)
    return 0


def data_share(plan: Any) -> str:
    """What this process reads of each batch: its DP groups' micro-batches, nothing else."""
    import jax  # noqa: PLC0415

    own = plan.microbatches_of(int(d.id) for d in jax.local_devices())
    return (f"data: this process reads {len(own)} of the {plan.n_microbatches} micro-batches "
            "of every batch (those of its data-parallel groups)")


def _copies_mode(args: argparse.Namespace, plan: Any, model: Any) -> str | None:
    """How this process keeps the survivors' copy of each step (host_snapshot.py), if at all."""
    if args.checkpoint_dir is None or args.survivor_copies == "off":
        return None
    if args.survivor_copies == "auto":
        import jax  # noqa: PLC0415

        from resihp_jax.perfmodel import memory_bytes_per_device  # noqa: PLC0415
        from resihp_jax.perfmodel.costs import MASTER_BYTES  # noqa: PLC0415
        from resihp_jax.perfmodel.work import stage_param_counts  # noqa: PLC0415
        from resihp_jax.runtime.recovery.host_snapshot import auto_mode  # noqa: PLC0415

        stats = jax.local_devices()[0].memory_stats() or {}
        step_bytes = float(memory_bytes_per_device(plan, model).max())
        # a kept state: float32 parameters and Adam's two moments
        state_bytes = float(stage_param_counts(plan, model, None).max()) * 3 * MASTER_BYTES \
            / plan.tp
        return auto_mode(jax.default_backend(), step_bytes, state_bytes,
                         stats.get("bytes_limit"))
    return str(args.survivor_copies)


def _job_plan(args: argparse.Namespace, job: Any, model: Any, needed: int, out: TextIO) -> Any:
    """The requested plan on this job's usable devices, or the scheduler's plan for them."""
    from resihp_jax.runtime.job.plan import cover_processes, plan_for_devices  # noqa: PLC0415

    if job.spec.single:
        devices = select_devices(args.devices or needed)
        if len(devices) > needed:
            print(f"using the first {needed} of the {len(devices)} devices for plan "
                  f"{args.plan}", file=out)
    else:
        print(f"job: {job.spec.describe()}, {len(job.hosts)} process(es)", file=out)
        for host in job.excluded_here():
            print(f"job: host {host} is excluded by the health record "
                  f"({job.record.excluded[host].reason})", file=out)
        devices = job.usable_devices()
    requested = plan_from_args(args, model.n_layers)
    plan, why = plan_for_devices(requested, model, [int(d.id) for d in devices],
                                 slow=job.slow_devices(), remat=args.remat)
    if not job.spec.single:
        plan = cover_processes(plan, {int(d.id): d.process_index for d in devices})
    if why != "as requested":
        print(f"plan: {why}", file=out)
    return plan


def _report(records: list, out: TextIO) -> None:
    steady = records[1:] or records  # the first step includes compilation
    tokens_per_s = sum(r.tokens for r in steady) / sum(r.step_time_s for r in steady)
    print(f"final loss {records[-1].loss:.4f} (first {records[0].loss:.4f}); "
          f"{tokens_per_s:,.0f} tokens/s after the first (compiling) step", file=out)
