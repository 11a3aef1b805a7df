"""`resihp train`: flags -> typed configs -> the library's TrainingRun (runtime/run/).

`--steps` counts from the start of the run (`--steps 6 --resume` after a run of 3 trains
steps 4 to 6), and `--resume` with no checkpoint yet starts from step 0, so a requeued
cluster job runs the same command again. The same command is one process of a job of
several (runtime/job/distributed.py). Every flag becomes a field of a typed config here, so
a script that builds the same configs runs exactly what this command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Any, Mapping, TextIO

from resihp_jax.cli.args import (METRICS_HELP, add_compile_cache_arguments,
                                 add_metrics_argument, compile_cache_dir, model_from_args,
                                 parse_int_list, parse_mesh)
from resihp_jax.cli.train_checks import check_train_args, checkpoint_every, read_metrics_args
from resihp_jax.env_vars import JOB_SPEC_ENV, METRICS_ENV
from resihp_jax.errors import CheckpointFallbackWarning, ConfigError
from resihp_jax.plan import Plan
from resihp_jax.models.registry import MODELS, check_plan
from resihp_jax.perfmodel.costs import REMAT_AUTO, REMAT_POLICIES
from resihp_jax.runtime.job import distributed
from resihp_jax.runtime.job.devices import devices_to_request, request_host_devices
from resihp_jax.runtime.job.exits import run_as_job_process
from resihp_jax.runtime.config import RESUME_FORCE, ResilienceConfig, RunConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=None,
                        help="devices to start (default: what the plan needs, dp*pp*tp); with "
                             "more, the plan uses the first ones; fake CPU devices when no "
                             "accelerator")
    parser.add_argument("--plan", default="dp=2,pp=2,tp=2", help="mesh, e.g. dp=2,pp=2,tp=2")
    parser.add_argument("--layers", help="layers per stage, e.g. 1,3 (default: even)")
    parser.add_argument("--microbatches", default=None,
                        help="micro-batches per DP group, e.g. 3,1 (default: 2 per group)")
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS),
                        help="a model of the registry: a preset of rh.models.Llama, or gpt2 "
                             "(rh.models.GPT2, a user's model as users write one: tp=1 plans, "
                             "its own adamw at --lr); every one trained through the one step "
                             "(rh.fit's) (default tiny)")
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
    parser.add_argument("--remat", nargs="?", const="full", default=REMAT_AUTO,
                        choices=(REMAT_AUTO, *REMAT_POLICIES),
                        help="what the backward recomputes: auto (default: for each plan the "
                             "least recomputing policy whose compiled step fits the devices' "
                             "memory), none, projections (keep the matmuls' and attention's "
                             "outputs, recompute the rest) or full (each stage's forward; "
                             "--remat alone)")
    add_metrics_argument(parser, METRICS_HELP + " (a JSON lines file is appended to when "
                         f"resuming; default: ${METRICS_ENV}, which resihp launch --metrics sets)")
    parser.add_argument("--profile", default=None, metavar="FIRST:END",
                        help="trace steps FIRST..END-1 with jax.profiler into the metrics "
                             "directory (the tensorboard:DIR of --metrics; TensorBoard's "
                             "profile tab); kill -USR2 PID traces the next 3 steps anyway")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save checkpoints here (orbax, asynchronous); it must hold no "
                             "checkpoints unless --resume is given")
    parser.add_argument("--checkpoint-every", default=None, metavar="N",
                        help="save every N steps, or 'auto' (the default): an interval in "
                             "seconds from a save's measured blocking cost and the job's "
                             "expected time between failures (Young's sqrt(2 C M), at most "
                             "30 min). A save due while the previous write goes on is put off "
                             "to the next step; the last step is always saved")
    parser.add_argument("--resume", nargs="?", const=True, default=False, type=resume_mode,
                        metavar="force",
                        help="continue from the newest good checkpoint in --checkpoint-dir "
                             "(any plan; model, optimizer, data and batch shape must match, "
                             "else the run is refused naming what changed); with none there "
                             "yet, start from step 0. '--resume force': continue even from "
                             "another run's checkpoint, printing what differed")
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
                             "memory, else host; none in a run of one process (no survivor "
                             "to serve: SIGTERM then saves a checkpoint of the step under way "
                             "and exits 74) unless --local-copy-dir is given")
    parser.add_argument("--local-copy-dir", default=None, metavar="DIR",
                        help="with --checkpoint-dir: write the survivors' copies to this "
                             "node-local directory (e.g. /dev/shm, kept across the job steps "
                             "of a SLURM allocation) instead of the checkpoint directory, which "
                             "gets only their manifests; a relaunch onto the same plan with "
                             "every rank on its old node (a spare in a failed node's place) "
                             "restores in place, filling what a node lacks from data-parallel "
                             "replicas; otherwise the files are published to the checkpoint "
                             "directory first (default: copies go to the checkpoint directory)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--adapt", action="store_true",
                        help="watch every step and re-plan around slow devices in place "
                             "(detector and scheduler; in a job of several processes, every "
                             "process follows process 0's verdict and plan). Without it the "
                             "same loop runs with nothing watched: step deadlines, checkpoints "
                             "and survivors' copies as ever, no probes or stage timing")
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
                             "compilation included, and the most any step may take beside "
                             "an asynchronous checkpoint write (default 120)")
    add_compile_cache_arguments(parser)
    add_job_arguments(parser)


def resume_mode(text: str) -> str:
    """--resume's optional value: only 'force' (a plain --resume is True)."""
    if text != RESUME_FORCE:
        raise argparse.ArgumentTypeError(f"{text!r}: give --resume alone, or '--resume "
                                         f"{RESUME_FORCE}' to continue from another run's "
                                         "checkpoint")
    return text


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """How this process joins a job of several processes (flags or RESIHP_* variables)."""
    env = JOB_SPEC_ENV
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="address of process 0's coordination service, for a job of "
                             f"several processes (or ${env['coordinator']}); with none given "
                             "under SLURM or Open MPI, JAX finds it itself")
    parser.add_argument("--num-processes", type=int, default=None,
                        help=f"processes in the job (or ${env['num_processes']})")
    parser.add_argument("--process-id", type=int, default=None,
                        help=f"this process's index, 0..N-1 (or ${env['process_id']})")
    parser.add_argument("--host-id", default=None,
                        help="stable name of this process in the job's health record (or "
                             f"${env['host_id']}; default: the host name, plus the local rank "
                             "when the cluster sets one)")


def job_spec_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ
                       ) -> distributed.JobSpec:
    return distributed.job_spec(args.coordinator, args.num_processes, args.process_id,
                                args.host_id, environ)


def plan_from_args(args: argparse.Namespace, n_layers: int) -> Plan:
    dp, pp, tp = parse_mesh(args.plan).values()  # in that order
    mbs = parse_int_list(args.microbatches, "--microbatches") if args.microbatches else (2,) * dp
    plan = Plan.uniform(dp, pp, tp, n_layers=n_layers, n_microbatches=max(sum(mbs), dp),
                        microbatch_size=args.microbatch_size, seq_len=args.seq_len)
    changes: dict[str, object] = {"microbatches_per_group": mbs}
    if args.layers:
        changes["layers_per_stage"] = parse_int_list(args.layers, "--layers")
    return plan.replace(**changes)


def run_config_from_args(args: argparse.Namespace, cache: str | None) -> RunConfig:
    """The flags as a RunConfig."""
    if not hasattr(args, "metrics_destinations"):  # (check_train_args reads them)
        read_metrics_args(args)
    return RunConfig(
        steps=args.steps, seed=args.seed, data=args.data, resume=args.resume,
        survivor_copies=args.survivor_copies, metrics=args.metrics_destinations,
        profile_steps=args.profile_steps, progress=not args.no_progress,
        devices=args.devices, resilience=resilience_from_args(args, cache))


def resilience_from_args(args: argparse.Namespace, cache: str | None) -> ResilienceConfig:
    """The resilience flags as a ResilienceConfig: with --adapt the detector and scheduler
    (compiling ahead only what --precompile asks), else nothing watched."""
    settings = dict(
        checkpoint_dir=args.checkpoint_dir, local_copy_dir=args.local_copy_dir,
        checkpoint_interval=checkpoint_every(args.checkpoint_every),
        hang_floor_s=args.hang_floor_s, step_timeout_s=args.step_timeout_s,
        compile_cache_dir=cache, precompile=args.precompile,
        background_compile=not args.no_background_compile)
    if args.adapt:
        return ResilienceConfig(**settings)
    return ResilienceConfig.unwatched(**settings)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout  # looked up per call, so a redirected stdout is honoured
    check_train_args(args)
    spec = job_spec_from_args(args)
    config = run_config_from_args(args, compile_cache_dir(args))
    model = model_from_args(args)
    plan = plan_from_args(args, model.n_layers)  # the requested plan
    check_plan(model, plan, f"--plan {args.plan}")
    plan.check(model)  # its layers, tp dimensions and attention block, before JAX starts
    if spec.single:
        request_host_devices(devices_to_request(args.devices, plan.n_devices, args.plan))
    elif args.devices is not None:
        raise ConfigError(f"--devices={args.devices}: in a job of several processes each "
                          "process uses the devices it was given; remove --devices")
    from resihp_jax.runtime.programs.compiles import install  # noqa: PLC0415
    from resihp_jax.runtime.recovery.restore import orbax_read_noise_silenced  # noqa: PLC0415
    from resihp_jax.runtime.run.programs import registered_programs  # noqa: PLC0415
    from resihp_jax.runtime.run.training import TrainingRun, ladder_of  # noqa: PLC0415
    from resihp_jax.step.config import StepConfig  # noqa: PLC0415

    ladder = ladder_of(config.resilience)

    def train() -> None:
        install()  # the start-up's count of compiles includes the programs' own, below
        started = time.time()
        # a job's process joins before the model's programs first touch a device (the
        # attention kernel is picked and checked on one); alone, a no-op
        distributed.initialize(spec, ladder.init_timeout_s, ladder.heartbeat_timeout_s)
        # any registry model, a preset as any other, with its own optimizer at --lr
        facts, programs = registered_programs(model, plan.seq_len, args.seed, args.lr)
        TrainingRun(facts, StepConfig(remat=args.remat), plan, config, spec, out,
                    programs=programs, compiles_from=started).run()

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
            train()
            return 0
        return run_as_job_process(train, "resihp train")
