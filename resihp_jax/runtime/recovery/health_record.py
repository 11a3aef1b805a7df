"""The job's health record: a small JSON file beside the checkpoints that every incarnation
of a job reads at start, and the supervisor (or a cluster's restart hook) updates.

It names hosts (a process's stable identity: its host id, not its JAX process id, which is
renumbered on every relaunch) that are excluded and why, and slowdowns seen. Writes are
atomic (temporary file + rename), so a crash mid-write leaves the previous record.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resihp_jax.errors import CheckpointError

FILENAME = "health.json"
VERSION = 1


@dataclass(frozen=True)
class Exclusion:
    reason: str  # e.g. "killed (signal 9)", "hung: no progress for 12.0 s"
    step: int  # the step the job had completed when it happened


@dataclass
class HealthRecord:
    excluded: dict[str, Exclusion] = field(default_factory=dict)  # host id -> why
    slow: dict[str, float] = field(default_factory=dict)  # host id -> slowdown factor seen
    incarnations: int = 0  # how many times the job has started

    def exclude(self, host: str, reason: str, step: int) -> None:
        self.excluded[host] = Exclusion(reason, int(step))

    def usable(self, hosts: list[str]) -> list[str]:
        return [h for h in hosts if h not in self.excluded]

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, "incarnations": self.incarnations,
                "excluded": {h: vars(e) for h, e in sorted(self.excluded.items())},
                "slow": dict(sorted(self.slow.items()))}

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str) -> HealthRecord:
        try:
            if data.get("version") != VERSION:
                raise ValueError(f"version {data.get('version')!r} (this library reads "
                                 f"{VERSION})")
            excluded = {str(h): Exclusion(str(e["reason"]), int(e["step"]))
                        for h, e in data.get("excluded", {}).items()}
            slow = {str(h): float(f) for h, f in data.get("slow", {}).items()}
            return cls(excluded, slow, int(data.get("incarnations", 0)))
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            raise CheckpointError(f"health record {where} is not valid: {err}") from None


def path_in(directory: str | Path) -> Path:
    return Path(directory) / FILENAME


def load(directory: str | Path | None) -> HealthRecord:
    """The record in `directory` (an empty one if there is none yet, or no directory: a run
    without checkpoints keeps no record)."""
    if directory is None or not (path := path_in(directory)).exists():
        return HealthRecord()
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"health record {path} cannot be read: {err}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"health record {path} is not a JSON object")
    return HealthRecord.from_json(data, str(path))


def save(record: HealthRecord, directory: str | Path) -> Path:
    """Write atomically: readers see the old record or the new one, never half of one."""
    path = path_in(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record.to_json(), indent=1) + "\n")
    os.replace(tmp, path)
    return path
