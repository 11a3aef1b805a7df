"""Where a run's metrics go (`tensorboard:DIR`, `wandb:PROJECT`, `jsonl:PATH` or a bare path,
an object with `write`), each checked when given, before any device starts."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Any

from resihp_jax.env_vars import METRICS_ENV, REPLICA_ENV
from resihp_jax.errors import ConfigError

VALID = ("tensorboard:DIR, wandb:PROJECT (or ENTITY/PROJECT), jsonl:PATH, a file path "
         "(JSON lines), or an object with a write(entry) method")
# kind -> (the library it writes with, the extra that installs it)
LIBRARIES = {"tensorboard": ("tensorboardX", "tensorboard"), "wandb": ("wandb", "wandb")}
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9_+-]*):(.*)", re.DOTALL)


@dataclass(frozen=True)
class Destination:
    """One place metrics go: `kind` tensorboard | wandb | jsonl | object, and its target (a
    directory, a project, a file path, or the object itself)."""
    kind: str
    target: Any

    def describe(self) -> str:
        if self.kind == "object":
            return f"{type(self.target).__name__} object"
        return f"{self.kind}:{self.target}"


def launched_metrics(environ: Any = None) -> tuple[str, ...] | None:
    """The metrics destinations `resihp launch --metrics` gave this process (METRICS_ENV,
    one a line), if any: `resihp train` and rh.fit write there unless given their own."""
    text = (os.environ if environ is None else environ).get(METRICS_ENV, "")
    found = tuple(line for line in text.splitlines() if line.strip())
    return found or None


def for_replica(destinations: tuple[Destination, ...], environ: Any = None
                ) -> tuple[Destination, ...]:
    """In a replica of a job of replicas (REPLICA_ENV), a JSON lines file and a TensorBoard
    directory of its own (`steps.jsonl` -> `steps.replica1.jsonl`, DIR -> DIR/replica1): the
    replicas are given the same destinations and each writes every step. Elsewhere unchanged."""
    replica = (os.environ if environ is None else environ).get(REPLICA_ENV)
    if replica is None:
        return destinations
    out = []
    for d in destinations:
        if d.kind == "jsonl":
            root, ext = os.path.splitext(str(d.target))
            d = Destination("jsonl", f"{root}.replica{replica}{ext}")
        elif d.kind == "tensorboard":
            d = Destination("tensorboard", os.path.join(str(d.target), f"replica{replica}"))
        out.append(d)
    return tuple(out)


def parse_destinations(metrics: Any, name: str = "metrics") -> tuple[Destination, ...]:
    """`metrics` (None, one destination, or a sequence of them) as Destinations; ConfigError
    in one line, naming `name` and the valid forms, for anything else."""
    if metrics is None:
        return ()
    if isinstance(metrics, (str, os.PathLike)) or hasattr(metrics, "write"):
        metrics = [metrics]
    if isinstance(metrics, Destination):
        return (metrics,)
    try:
        items = list(metrics)
    except TypeError:
        raise ConfigError(f"{name}={metrics!r}: expected {VALID}, or a list of them") from None
    out = tuple(item if isinstance(item, Destination) else parse_one(item, name)
                for item in items)
    for kind in ("jsonl", "tensorboard"):
        targets = [os.path.abspath(d.target) for d in out if d.kind == kind]
        if len(set(targets)) < len(targets):
            raise ConfigError(f"{name}: {kind} destination given twice ({targets[0]})")
    return out


def parse_one(item: Any, name: str = "metrics") -> Destination:
    if hasattr(item, "write") and not isinstance(item, (str, os.PathLike)):
        if not callable(item.write):
            raise ConfigError(f"{name}: {type(item).__name__}.write is not callable")
        return Destination("object", item)
    if isinstance(item, os.PathLike):
        item = os.fspath(item)
    if not isinstance(item, str):
        raise ConfigError(f"{name}={item!r}: expected {VALID}")
    match = _SCHEME.fullmatch(item)
    if match is None or len(match.group(1)) == 1:  # a plain path (C:\... is one too)
        return Destination("jsonl", _target(item, item, name))
    kind, target = match.group(1).lower(), match.group(2)
    if kind not in ("tensorboard", "wandb", "jsonl"):
        raise ConfigError(f"{name}={item!r}: unknown destination {kind!r}; valid are {VALID}")
    check_library(kind, item, name)
    return Destination(kind, _target(target, item, name))


def _target(target: str, item: str, name: str) -> str:
    if not target.strip():
        raise ConfigError(f"{name}={item!r}: nothing after the colon; valid are {VALID}")
    return target


def check_library(kind: str, item: str, name: str = "metrics") -> None:
    """ConfigError naming the `pip install` to run when `kind`'s library is missing."""
    if kind not in LIBRARIES:
        return
    module, extra = LIBRARIES[kind]
    if not _installed(module):
        raise ConfigError(f"{name}={item!r} needs {module}, which is not installed: "
                          f"pip install 'resihp_jax[{extra}]'")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules: not importable
        return False


def metrics_directory(destinations: tuple[Destination, ...]) -> str | None:
    """Where a profile goes: the first TensorBoard directory, else beside a JSON lines file."""
    for d in destinations:
        if d.kind == "tensorboard":
            return str(d.target)
    for d in destinations:
        if d.kind == "jsonl":
            return os.path.dirname(os.path.abspath(d.target))
    return None
