"""How the suite is laid over its two workers (this module imports neither JAX nor pytest).

The suite is compile-bound on a 2-core machine, so where its time goes decides whether CI
fits its budget. Two rules, both read by tests/conftest.py:
- the files whose tests start several JAX processes run one after another on one worker
  (one work unit, `PROCESSES`): two of them at once put 8 processes on 2 cores, and their
  deadlines, derived from measured step times, then judge a machine that is not the one
  they measured;
- the heaviest work units go first (by the per-file seconds of the last recorded run,
  tests/durations.json), so that no long file starts last while the other worker idles.
Every run prints its per-file seconds; `pytest --durations-json tests/durations.json`
records them for the next run's order.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path

DURATIONS_FILE = Path(__file__).with_name("durations.json")
PROCESSES = "processes"
# test files whose tests run several JAX processes at once (a launch, a supervisor's job,
# tests.helpers.run_processes): tests/test_schedule.py checks the list against the sources
PROCESS_FILES = frozenset({
    "tests/cli/test_launch_flags.py",
    "tests/runtime/job/test_coordinator.py",
    "tests/runtime/job/test_job_parts.py",
    "tests/runtime/job/test_launch_script.py",
    "tests/runtime/job/test_launched.py",
    "tests/runtime/job/test_multiprocess.py",
    "tests/runtime/job/test_user_slow.py",
    "tests/runtime/recovery/test_cadence_multiprocess.py",
    "tests/runtime/recovery/test_local_copies_multiprocess.py",
    "tests/runtime/replicas/test_torchft_engine.py",
    "tests/runtime/test_replica_job.py",
    "tests/cli/test_replica_recipes.py",
    "tests/runtime/trainer/test_agreement.py",
})


def file_of(nodeid: str) -> str:
    """The test file of a pytest node id ('tests/a/test_b.py::test_c[x]' -> 'tests/a/test_b.py')."""
    return nodeid.split("::", 1)[0]


def unit_of(nodeid: str) -> str:
    """The work unit a node runs in: its file, or PROCESSES for the multi-process files."""
    path = file_of(nodeid)
    return PROCESSES if path in PROCESS_FILES else path


def load_seconds(path: Path = DURATIONS_FILE) -> dict[str, float]:
    """Per-file seconds of the last recorded run; empty where none was recorded."""
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def unit_seconds(files: Iterable[str], seconds: Mapping[str, float]) -> dict[str, float]:
    """Expected seconds of each work unit of `files`; a file never recorded counts as the
    median recorded file (a new file is neither sent last nor put before the known heavy)."""
    typical = statistics.median(seconds.values()) if seconds else 0.0
    units: dict[str, float] = {}
    for path in files:
        unit = PROCESSES if path in PROCESS_FILES else path
        units[unit] = units.get(unit, 0.0) + seconds.get(path, typical)
    return units


def heaviest_first(nodeids: list[str], seconds: Mapping[str, float]) -> list[str]:
    """`nodeids` reordered unit by unit, heaviest unit first; each unit's nodes stay
    together and in their collected order (module fixtures are built once)."""
    files = list(dict.fromkeys(file_of(n) for n in nodeids))
    weight = unit_seconds(files, seconds)
    rank = {unit: i for i, unit in enumerate(sorted(weight, key=lambda u: -weight[u]))}
    return sorted(nodeids, key=lambda n: rank[unit_of(n)])  # stable: collected order kept


def per_file(durations: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Seconds per test file from (node id, seconds of one phase) pairs, heaviest first."""
    total: dict[str, float] = {}
    for nodeid, seconds in durations:
        path = file_of(nodeid)
        total[path] = total.get(path, 0.0) + seconds
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def table(seconds: Mapping[str, float]) -> list[str]:
    """The per-file lines a run prints: seconds, share of the total, file (multi-process
    files marked)."""
    total = sum(seconds.values()) or 1.0
    lines = [f"{s:8.1f} s {100 * s / total:5.1f}%  {path}"
             + ("  [processes]" if path in PROCESS_FILES else "") for path, s in seconds.items()]
    group = sum(s for path, s in seconds.items() if path in PROCESS_FILES)
    return lines + [f"{sum(seconds.values()):8.1f} s in {len(seconds)} files; the multi-process "
                    f"files (one worker, one after another) {group:.1f} s"]
