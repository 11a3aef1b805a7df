"""`resihp train` argument checks that need no JAX: each mistake is one ConfigError naming
the flag before any device starts, not a traceback minutes later."""

from __future__ import annotations

import argparse
import math

from resihp_jax.cli.args import check_output_dir, metrics_destinations, parse_profile
from resihp_jax.errors import ConfigError
from resihp_jax.metrics.destinations import parse_destinations
from resihp_jax.runtime.recovery.cadence import AUTO
from resihp_jax.runtime.recovery.checkpoint_dir import refuse_held


def check_train_args(args: argparse.Namespace) -> None:
    """ConfigError for the first invalid flag; creates `--checkpoint-dir` if missing."""
    for name in ("steps", "microbatch_size", "seq_len"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ConfigError(f"--lr={args.lr}: must be a finite number > 0")
    _check_checkpoint_flags(args)
    if args.precompile < 0:
        raise ConfigError(f"--precompile={args.precompile}: must be >= 0")
    if args.precompile and not args.adapt:
        raise ConfigError("--precompile needs --adapt (only an adapting run switches plans)")
    if args.no_background_compile and not args.adapt:
        raise ConfigError("--no-background-compile needs --adapt (only an adapting run "
                          "switches plans)")
    read_metrics_args(args)
    if args.checkpoint_dir is None:
        return
    if not args.resume:
        refuse_held(args.checkpoint_dir, f"--checkpoint-dir={args.checkpoint_dir!r}",
                    "pass --resume")
    check_output_dir(args.checkpoint_dir, "--checkpoint-dir")


def read_metrics_args(args: argparse.Namespace) -> None:
    """--metrics (else what `resihp launch --metrics` passed on) and --profile, read into
    `args.metrics_destinations` and `args.profile_steps`."""
    from resihp_jax.metrics.destinations import launched_metrics  # noqa: PLC0415

    given = args.metrics or list(launched_metrics() or ())
    args.metrics_destinations = metrics_destinations(given)
    args.profile_steps = parse_profile(args.profile)
    if args.profile_steps is not None and not any(
            d.kind in ("tensorboard", "jsonl")
            for d in parse_destinations(args.metrics_destinations, "--metrics")):
        raise ConfigError(f"--profile={args.profile}: the trace is written into the metrics "
                          "directory: give --metrics tensorboard:DIR too")


def _check_checkpoint_flags(args: argparse.Namespace) -> None:
    if args.checkpoint_dir is None:
        for flag, value in (("--resume", args.resume or None),
                            ("--checkpoint-every", args.checkpoint_every),
                            ("--local-copy-dir", args.local_copy_dir)):
            if value is not None:
                raise ConfigError(f"{flag} needs --checkpoint-dir DIR")
        return
    checkpoint_every(args.checkpoint_every)
    if args.local_copy_dir is not None:
        if args.survivor_copies == "off":
            raise ConfigError(f"--local-copy-dir={args.local_copy_dir!r} with "
                              "--survivor-copies off: there are no copies to write there")
        check_output_dir(args.local_copy_dir, "--local-copy-dir")


def checkpoint_every(text: str | None) -> int | str:
    """--checkpoint-every's value: 'auto' (the default) or a number of steps >= 1."""
    if text is None or text == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"--checkpoint-every={text}: give 'auto' (an interval from a save's "
                          "measured cost) or a number of steps >= 1")
    return value
