"""The suite's schedule (tests/schedule.py): the multi-process files as one unit, the heaviest
units first, the per-file seconds a run prints and records."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests import schedule

ROOT = Path(__file__).resolve().parents[1]
A, B, C = "tests/a/test_a.py", "tests/b/test_b.py", "tests/c/test_c.py"
PROC = sorted(schedule.PROCESS_FILES)[0]


def test_heaviest_unit_first_each_unit_together_in_collected_order() -> None:
    nodeids = [f"{A}::t1", f"{B}::t1", f"{A}::t2", f"{C}::t1", f"{B}::t2"]
    order = schedule.heaviest_first(nodeids, {A: 1.0, B: 30.0, C: 5.0})
    assert order == [f"{B}::t1", f"{B}::t2", f"{C}::t1", f"{A}::t1", f"{A}::t2"]


def test_the_multi_process_files_are_one_unit_weighed_together() -> None:
    other = sorted(schedule.PROCESS_FILES)[1]
    assert schedule.unit_of(f"{PROC}::t[x]") == schedule.unit_of(f"{other}::t") == \
        schedule.PROCESSES
    assert schedule.unit_of(f"{A}::t") == A
    # two process files of 10 s each outweigh one single-process file of 15 s
    order = schedule.heaviest_first([f"{A}::t", f"{PROC}::t", f"{other}::t"],
                                    {A: 15.0, PROC: 10.0, other: 10.0})
    assert order[-1] == f"{A}::t"


def test_a_file_never_recorded_weighs_the_median_file() -> None:
    assert schedule.unit_seconds([A, B, C], {A: 1.0, B: 9.0, "tests/x.py": 4.0})[C] == 4.0
    assert schedule.unit_seconds([A], {}) == {A: 0.0}


def test_per_file_seconds_sum_every_phase_heaviest_first() -> None:
    seconds = schedule.per_file([(f"{A}::t1", 1.0), (f"{A}::t1", 0.5), (f"{B}::t[p]", 3.0)])
    assert list(seconds.items()) == [(B, 3.0), (A, 1.5)]
    lines = schedule.table(seconds)
    assert lines[0].endswith(B) and lines[1].endswith(A) and "4.5 s in 2 files" in lines[-1]


def test_recorded_seconds_load_and_a_bad_file_is_no_record(tmp_path: Path) -> None:
    good, bad = tmp_path / "d.json", tmp_path / "bad.json"
    good.write_text(json.dumps({A: 2}))
    bad.write_text("[1, 2")
    assert schedule.load_seconds(good) == {A: 2.0}
    assert schedule.load_seconds(bad) == schedule.load_seconds(tmp_path / "none.json") == {}


# what starts several JAX processes in a test: tests.helpers.run_processes with more than one,
# a list of Popen'd tasks, a Supervisor's job, `resihp launch`
_SPAWNS = re.compile(r"run_processes\([^)]*?,\s*[2-9]|\[subprocess\.Popen\(|"
                     r"\bsupervisor\.run\(\)|\"launch\", \"--procs\"")


def test_the_process_files_are_the_files_that_start_processes() -> None:
    spawning = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                if _SPAWNS.search(p.read_text())}
    assert spawning <= schedule.PROCESS_FILES, sorted(spawning - schedule.PROCESS_FILES)
    missing = [p for p in schedule.PROCESS_FILES if not (ROOT / p).is_file()]
    assert not missing, missing
