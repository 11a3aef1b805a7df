"""`resihp launch`: N local processes of one training job, supervised and relaunched on the
survivors when one dies or hangs: on a GPU node each process gets its share of the node's GPUs
(NCCL collectives), else fake CPU devices (gloo collectives, loopback only)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable, TextIO

from resihp_jax.cli.args import (METRICS_HELP, add_metrics_argument, check_output_dir,
                                 metrics_destinations)
from resihp_jax.env_vars import METRICS_ENV
from resihp_jax.errors import ConfigError
from resihp_jax.faults.processes import Fault
from resihp_jax.runtime.job import accelerators
from resihp_jax.runtime.job.launch_types import LaunchConfig
from resihp_jax.runtime.job.supervisor import Supervisor


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--procs", type=int, required=True, help="processes to start (N)")
    parser.add_argument("--devices-per-proc", type=int, default=None,
                        help="devices per process: on a GPU node, GPUs of the node (process i "
                             "gets the i-th share, through CUDA_VISIBLE_DEVICES; default 1), "
                             "else fake CPU devices (default 2)")
    parser.add_argument("--platform", choices=accelerators.PLATFORMS, default="auto",
                        help="gpu: share the node's GPUs (nvidia-smi -L, narrowed to "
                             "CUDA_VISIBLE_DEVICES where set) among the processes; cpu: fake "
                             "CPU devices; auto (default): gpu where the node lists a GPU")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="checkpoints, health record, heartbeats and logs (default: a new "
                             "temporary directory)")
    parser.add_argument("--kill", action="append", default=[], metavar="P@STEP",
                        help="SIGKILL process P when the job reaches STEP (repeatable)")
    parser.add_argument("--hang", action="append", default=[], metavar="P@STEP",
                        help="SIGSTOP process P when the job reaches STEP (repeatable)")
    parser.add_argument("--slow", action="append", default=[], metavar="P=FACTOR@STEP",
                        help="from STEP, let process P run only 1/FACTOR of the time (a CPU "
                             "quota enforced with SIGSTOP/SIGCONT; repeatable)")
    parser.add_argument("--readmit-after", type=int, default=None, metavar="STEPS",
                        help="an excluded process comes back (a repaired host) once the job "
                             "is STEPS steps past its exclusion; the job restarts to take it "
                             "in (default: never)")
    parser.add_argument("--replicas", type=int, default=1, metavar="R",
                        help="split the N processes into R replicas of N/R consecutive "
                             "processes: each its own JAX job with the same mesh, averaging "
                             "gradients with the others through torchft. A dead or hung "
                             "process restarts its replica alone; the others train on and "
                             "the restarted one heals from a peer (default 1: one job; "
                             'needs pip install "resihp_jax[ft]")')
    parser.add_argument("--max-restarts", type=int, default=8,
                        help="give up after this many relaunches (default 8)")
    parser.add_argument("--no-standby", action="store_true",
                        help="keep no warm standby. By default, beside a running incarnation "
                             "of N >= 2 processes (from the job's start, and after a relaunch "
                             "once it has trained its first step), N-1 more processes start, "
                             "join a job of their own, plan and compile as a relaunch without "
                             "one process would, and wait; when one process dies or hangs "
                             "they take over (no process start, no compile). It costs the "
                             "memory of N-1 idle processes and, while they compile, CPU the "
                             "job would otherwise use")
    add_metrics_argument(parser, METRICS_HELP + ". Every process's run writes there (the "
                         f"{METRICS_ENV} variable: resihp train and rh.fit take it unless given "
                         "their own), and the launcher each relaunch (cause, seconds to "
                         "recover, steps lost): in DIR/launch for TensorBoard, a run named "
                         "launch for W&B")
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="-- then either your own command for every process (e.g. -- "
                             "python my_train.py ARGS, a script that calls rh.fit: it joins "
                             "the job from the RESIHP_* variables) or, when the first "
                             "argument starts with '-', the arguments of `resihp train`")


def parse_fault(kind: str, text: str) -> Fault:
    pattern = r"(\d+)=([\d.]+)@(\d+)" if kind == "slow" else r"(\d+)@(\d+)"
    match = re.fullmatch(pattern, text)
    if not match:
        example = "1=3.0@5" if kind == "slow" else "2@5"
        raise ConfigError(f"--{kind}={text!r}: expected "
                          f"{'P=FACTOR@STEP' if kind == 'slow' else 'P@STEP'}, e.g. {example}")
    if kind == "slow":
        factor = float(match.group(2))
        if factor <= 1:
            raise ConfigError(f"--slow={text!r}: FACTOR must be > 1")
        return Fault(kind, int(match.group(1)), int(match.group(3)), factor)
    return Fault(kind, int(match.group(1)), int(match.group(2)))


def _user_command(raw: list[str]) -> tuple[str, ...] | None:
    """The user's own command after `--` (its first word does not start with '-'), if any."""
    args = raw[1:] if raw[:1] == ["--"] else raw
    if not args or args[0].startswith("-"):
        return None
    if args[0] in ("python", "python3"):  # the interpreter this command runs under
        return (sys.executable, *args[1:])
    return tuple(args)


class _RefusingParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"train argument refused: {message}")


def _train_args(raw: list[str]) -> tuple[str, ...]:
    """The arguments of `resihp train`, refused here if it would refuse them: each process
    would otherwise fail the same way, relaunch after relaunch."""
    from resihp_jax.cli import train as train_cli  # noqa: PLC0415

    args = raw[1:] if raw[:1] == ["--"] else raw
    for owned in ("--coordinator", "--num-processes", "--process-id", "--host-id",
                  "--checkpoint-dir", "--devices"):
        if owned in args:
            raise ConfigError(f"train argument {owned} is set by resihp launch; remove it")
    parser = _RefusingParser(prog="resihp train")
    train_cli.add_arguments(parser)
    parser.parse_args(args)
    return tuple(args)


def devices(args: argparse.Namespace,
            gpus: Callable[[], tuple[str, ...]] = accelerators.node_gpus
            ) -> tuple[str, int, tuple[str, ...]]:
    """(platform, devices per process, the node's GPUs) for these arguments; the GPUs are
    read from the driver's listing, never by starting JAX here."""
    found = gpus() if args.platform != "cpu" else ()
    platform = accelerators.resolve_platform(args.platform, found)
    return platform, accelerators.devices_per_proc(args.devices_per_proc, platform), found


def run(args: argparse.Namespace, out: TextIO | None = None,
        gpus: Callable[[], tuple[str, ...]] = accelerators.node_gpus) -> int:
    out = out or sys.stdout  # looked up per call, so a redirected stdout is honoured
    faults = tuple(parse_fault(kind, text) for kind in ("kill", "hang", "slow")
                   for text in getattr(args, kind))
    check_output_dir(args.checkpoint_dir, "--checkpoint-dir")
    directory = Path(args.checkpoint_dir or tempfile.mkdtemp(prefix="resihp-launch-"))
    if args.replicas != 1:  # refused before anything is printed or made
        from resihp_jax.runtime.replicas.split import check_replicas  # noqa: PLC0415

        check_replicas(args.procs, args.replicas)
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts={args.max_restarts}: must be >= 0")
    metrics = metrics_destinations(args.metrics) or ()
    command = _user_command(args.train_args)
    platform, per_proc, found = devices(args, gpus)
    config = LaunchConfig(args.procs, per_proc, directory.absolute(),
                          () if command else _train_args(args.train_args), faults,
                          args.max_restarts, readmit_after_steps=args.readmit_after,
                          command=command, standby=not args.no_standby, platform=platform,
                          gpus=found, metrics=metrics)
    what = (f"GPU(s) each, of the node's {len(found)}" if platform == "gpu"
            else "fake CPU devices")
    print(f"resihp launch: {config.procs} processes x {per_proc} {what}, job directory "
          f"{directory}", file=out)
    if platform == "gpu" and config.standby:
        print("resihp launch: no warm standby on GPUs (it would hold GPU memory beside the "
              "job); a relaunch starts fresh processes", file=out)
    if args.replicas != 1:
        return _run_replicas(config, args.replicas, out)
    summary = Supervisor(config, out=sys.stderr).run()
    print(f"\n{'restarts':<14}{summary.restarts}\n{'steps lost':<14}{summary.steps_lost}\n"
          f"{'final step':<14}{summary.final_step}", file=out)
    for i, failure in enumerate(summary.failures):
        print(f"failure {i + 1}: {failure.kind}, {failure.detail}", file=out)
    for i, plan in enumerate(summary.plans):
        how = f" ({summary.relaunched_by[i - 1]})" if 0 < i <= len(summary.relaunched_by) else ""
        print(f"incarnation {i}: {plan}{how}", file=out)
    print(json.dumps(summary.to_json()), file=out)
    return 0


def _run_replicas(config: LaunchConfig, n_replicas: int, out: TextIO) -> int:
    from resihp_jax.runtime.replica_job import ReplicaJob  # noqa: PLC0415
    from resihp_jax.runtime.replicas.torchft_engine import check_installed  # noqa: PLC0415

    check_installed()
    job = ReplicaJob(config, n_replicas, out=sys.stderr)
    print(f"resihp launch: {n_replicas} replicas of {config.procs // n_replicas} processes, "
          f"Lighthouse at {job.lighthouse.address}", file=out)
    summary = job.run()
    for r, replica in enumerate(summary.replicas):
        print(f"replica {r}: {replica.restarts} restarts, final step {replica.final_step}"
              + (f", gave up: {summary.errors[r]}" if r in summary.errors else ""), file=out)
    print(json.dumps(summary.to_json()), file=out)
    return 1 if summary.errors else 0
