"""The writers behind each destination (tensorboardX, wandb, JSON lines, a user's object),
called on the metrics thread, never on the loop's."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TextIO

from resihp_jax.errors import ConfigError
from resihp_jax.metrics.destinations import Destination
from resihp_jax.metrics.entry import MetricsEntry


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def text_tag(kind: str) -> str:
    """Where an entry's text goes: the plan as `plan`, an event as `events/<kind>`."""
    return "plan" if kind == "plan" else f"events/{kind}"


class TensorBoardWriter:
    """Scalars at their step; each event's line as text (`events/<kind>`, the plan as
    `plan`), so a re-plan lines up with the throughput curve."""

    def __init__(self, directory: str) -> None:
        from tensorboardX import SummaryWriter  # noqa: PLC0415 - the [tensorboard] extra

        self.writer = SummaryWriter(directory, flush_secs=5)

    def write(self, entry: MetricsEntry) -> None:
        for tag, value in entry.scalars.items():
            self.writer.add_scalar(tag, value, entry.step)
        if entry.text:
            self.writer.add_text(text_tag(entry.kind), entry.text, entry.step)

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    """One W&B run: each entry logged at its step (events as text under `events/<kind>`).
    `WANDB_MODE` decides online or offline; without it, and with no API key set up here, the
    run is written offline (`wandb sync` uploads it later)."""

    def __init__(self, project: str, name: str | None = None,
                 say: Any = None) -> None:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb  # noqa: PLC0415 - the [wandb] extra

        entity, _, project = project.rpartition("/")
        mode = wandb_mode()
        if mode == "offline" and "WANDB_MODE" not in os.environ and say is not None:
            say(f"metrics: wandb:{project} is written offline (no W&B API key here); "
                "`wandb sync` uploads it")
        try:
            self.run = wandb.init(project=project, entity=entity or None, name=name, mode=mode,
                                  reinit="create_new",
                                  settings=wandb.Settings(console="off", x_disable_stats=True))
        except Exception as err:  # noqa: BLE001 - wandb raises its own kinds
            raise ConfigError(f"metrics wandb:{project}: {first_line(err)}") from None

    def write(self, entry: MetricsEntry) -> None:
        data: dict[str, Any] = dict(entry.scalars)
        if entry.text:
            data[text_tag(entry.kind)] = entry.text
        if data:
            self.run.log(data, step=entry.step)

    def close(self) -> None:
        self.run.finish()


def wandb_mode() -> str:
    """`WANDB_MODE` where set; else online when an API key is set up, else offline."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "online" if "api.wandb.ai" in netrc.read_text() else "offline"
    except OSError:
        return "offline"


class JsonlWriter:
    """Each step's whole record as one JSON line (events are for the dashboards)."""

    def __init__(self, path: str, start: int = 0, start_record: dict | None = None,
                 rejoin: bool = False) -> None:
        self.file = metrics_file(path, start, start_record, rejoin)

    def write(self, entry: MetricsEntry) -> None:
        if entry.kind == "step" and entry.record is not None:
            self.file.write(json.dumps(dict(entry.record)) + "\n")
            self.file.flush()

    def close(self) -> None:
        self.file.close()


def metrics_file(path: str, start: int, start_record: dict | None = None,
                 rejoin: bool = False) -> TextIO:
    """`path` opened for appending after keeping only the records of steps <= `start`
    (with `start_record` added if the record of step `start` is not among them); `rejoin`:
    a relaunched replica, which keeps every record (it heals past them, training none again)."""
    if rejoin:
        return open(path, "a")  # noqa: SIM115
    if start == 0:
        return open(path, "w")  # noqa: SIM115
    try:
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= start]
    except FileNotFoundError:
        kept = []
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"--metrics={path!r}: not a metrics file of this run (a line is not "
                          "a step record); choose another path") from None
    if start_record is not None and not any(json.loads(x)["step"] == start for x in kept):
        kept.append(json.dumps(start_record) + "\n")  # its writer died before writing it
    with open(path, "w") as f:
        f.writelines(kept)
    return open(path, "a")  # noqa: SIM115


def open_writer(destination: Destination, *, name: str | None = None, say: Any = None) -> Any:
    """The writer of a TensorBoard, W&B or object destination (JSON lines open at once)."""
    if destination.kind == "tensorboard":
        return TensorBoardWriter(str(destination.target))
    if destination.kind == "wandb":
        return WandbWriter(str(destination.target), name=name, say=say)
    if destination.kind == "object":
        return destination.target
    raise ConfigError(f"metrics: no writer for {destination.describe()}")
