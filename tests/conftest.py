"""Every test runs on 8 fake CPU devices; the flag must be set before JAX is imported.

The suite's schedule (tests/schedule.py says why): the multi-process files run as one work
unit on one worker, the heaviest units go first, and every run ends with its seconds per file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests import schedule
from tests.xla_flags import xla_flags  # JAX-free

os.environ.setdefault("XLA_FLAGS", xla_flags(8))  # and fast compiles: tests/xla_flags.py says why
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_PHASES: list[tuple[str, float]] = []  # (node id, seconds) of every phase this process saw


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--durations-json", metavar="PATH", default=None,
                     help="write this run's seconds per test file to PATH as JSON (the "
                          "next runs order their files by tests/durations.json)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = schedule.heaviest_first([item.nodeid for item in items], schedule.load_seconds())
    position = {nodeid: i for i, nodeid in enumerate(order)}
    items.sort(key=lambda item: position[item.nodeid])


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class _Units(LoadFileScheduling):
        """--dist loadfile with the multi-process files as one unit, in collected order
        (heaviest first, from pytest_collection_modifyitems), not xdist's by test count."""

        def _split_scope(self, nodeid: str) -> str:
            return schedule.unit_of(nodeid)

    config.option.loadscopereorder = False
    return _Units(config, log)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _PHASES.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:  # noqa: ANN001
    seconds = schedule.per_file(_PHASES)
    if not seconds:
        return
    terminalreporter.section("seconds per test file")
    for line in schedule.table(seconds):
        terminalreporter.write_line(line)
    out = config.getoption("--durations-json")
    if out:
        Path(out).write_text(json.dumps({k: round(v, 1) for k, v in seconds.items()},
                                        indent=1) + "\n")
