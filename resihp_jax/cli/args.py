"""Command-line values that describe a Plan: mesh terms and comma-separated splits."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from resihp_jax.env_vars import COMPILE_CACHE_ENV
from resihp_jax.errors import ConfigError, PlanError
from resihp_jax.models.registry import Entry, get_model

_MESH_RE = re.compile(r"^\s*(dp|pp|tp)\s*=\s*(\d+)\s*$")


def parse_mesh(text: str) -> dict[str, int]:
    """'dp=2,pp=2,tp=2' (any order; missing axes default to 1) -> {'dp': 2, 'pp': 2, 'tp': 2}."""
    out = {"dp": 1, "pp": 1, "tp": 1}
    seen: set[str] = set()
    for part in text.split(","):
        match = _MESH_RE.match(part)
        if not match:
            raise PlanError(f"bad mesh term {part!r} in {text!r}: expected e.g. dp=2,pp=2,tp=2")
        axis, value = match.group(1), int(match.group(2))
        if axis in seen:
            raise PlanError(f"mesh axis {axis} given twice in {text!r}")
        if value < 1:
            raise PlanError(f"mesh axis {axis}={value} in {text!r}: must be >= 1")
        seen.add(axis)
        out[axis] = value
    return out


def model_from_args(args: argparse.Namespace) -> Entry:
    """The registry's model `--model` (a Llama preset, or gpt2), in `--dtype` if given."""
    return get_model(args.model, "--model", **({"dtype": args.dtype} if args.dtype else {}))


def parse_int_list(text: str, what: str) -> tuple[int, ...]:
    """'1,3' -> (1, 3), with an error naming `what` on bad input."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise PlanError(f"{what}={text!r}: expected comma-separated integers like 1,3") from None
    if any(v < 1 for v in values):
        raise PlanError(f"{what}={text!r}: every entry must be >= 1")
    return values


def check_output_file(path: str | None, flag: str) -> None:
    """Fail before any work if `path` cannot be written as a file (checked without JAX)."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{flag}={path!r} is a directory; give a file path")
    parent = target.absolute().parent
    if not parent.is_dir():
        raise ConfigError(f"{flag}={path!r}: folder {str(parent)!r} does not exist")
    existed = target.exists()
    try:  # root passes os.access everywhere; only a real open tells (/proc, read-only mounts)
        with open(target, "a"):
            pass
    except OSError as err:
        raise ConfigError(f"{flag}={path!r}: not writable ({err.strerror})") from None
    if not existed:
        target.unlink(missing_ok=True)  # the processes of one job all check the same path


def check_output_dir(path: str | None, flag: str) -> None:
    """Fail before any work if `path` cannot be used (created if missing) as a directory."""
    if path is None:
        return
    target = Path(path).absolute()
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{flag}={path!r} exists and is not a directory")
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag}={path!r}: cannot create or write there "
                          f"({str(existing)!r} is not a writable directory)")
    try:  # some filesystems (/proc, read-only mounts) say writable and still refuse
        target.mkdir(parents=True, exist_ok=True)
        probe = target / f".resihp-write-check-{os.getpid()}"  # unique: hosts share dirs
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"{flag}={path!r}: not usable as a directory ({err.strerror})") \
            from None


def add_compile_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """`--compile-cache DIR` / `--no-compile-cache` (JAX's persistent compilation cache)."""
    parser.add_argument("--compile-cache", default=None, metavar="DIR",
                        help="keep compiled programs here across runs (default: "
                             f"${COMPILE_CACHE_ENV}, else ~/.cache/resihp_jax/xla)")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="do not use the persistent compilation cache")


def compile_cache_dir(args: argparse.Namespace) -> str | None:
    """The cache directory the flags ask for (None: off); checked before JAX starts."""
    if args.no_compile_cache:
        if args.compile_cache is not None:
            raise ConfigError("--compile-cache and --no-compile-cache contradict each other")
        return None
    from resihp_jax.runtime.config import default_cache_dir  # noqa: PLC0415

    directory = args.compile_cache or default_cache_dir()
    check_output_dir(directory, "--compile-cache")
    return directory


METRICS_HELP = ("where to write metrics: tensorboard:DIR (TensorBoard event files; pip install "
                "'resihp_jax[tensorboard]'), wandb:PROJECT (a Weights & Biases run, offline "
                "without an API key; pip install 'resihp_jax[wandb]'), jsonl:PATH or a plain "
                "path (one JSON object per step); repeatable")


def add_metrics_argument(parser: argparse.ArgumentParser, help: str = METRICS_HELP) -> None:
    parser.add_argument("--metrics", action="append", default=None, metavar="DEST", help=help)


def metrics_destinations(values: list[str] | None) -> tuple[str, ...] | None:
    """--metrics as given (None: none), each checked before any work: its form, its
    library, and that its file or directory can be written."""
    from resihp_jax.metrics.destinations import parse_destinations  # noqa: PLC0415

    if not values:
        return None
    for destination in parse_destinations(values, "--metrics"):
        if destination.kind == "jsonl":
            check_output_file(destination.target, "--metrics")
        elif destination.kind == "tensorboard":
            check_output_dir(destination.target, "--metrics")
    return tuple(values)


def parse_profile(text: str | None) -> tuple[int, int] | None:
    """--profile FIRST:END -> (FIRST, END): the steps FIRST..END-1 are traced."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not match or not 1 <= int(match.group(1)) < int(match.group(2)):
        raise ConfigError(f"--profile={text!r}: expected FIRST:END with 1 <= FIRST < END, e.g. "
                          "10:13 traces steps 10, 11 and 12")
    return int(match.group(1)), int(match.group(2))
