"""The run's account of what resilience cost: its parts add up to the total it reports, each
share is of the same wall time, and a real run's saves show in it."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from resihp_jax.runtime.trainer.overhead import PARTS, run_overhead


def _records(ends: list[float], copies: list[float]) -> list[SimpleNamespace]:
    return [SimpleNamespace(end_unix_s=e, step_time_s=0.1, host_copy_s=c)
            for e, c in zip(ends, copies)]


def test_the_parts_add_up_to_the_total_over_the_same_wall_time() -> None:
    # 11 steps ending 1 s apart: 10 s of training after the first (compiling) step; its copy
    # (5 s) is not counted, the others' 0.01 s each are
    records = _records([100.0 + i for i in range(11)], [5.0] + [0.01] * 10)
    cost = run_overhead(records, budget=0.02, checkpoints_s=0.06, detector_s=0.02,
                        probes_s=0.03, timing_s=0.01)
    assert cost.wall_s == 10.0
    assert cost.seconds["copies"] == pytest.approx(0.1)
    assert cost.total_s == pytest.approx(0.06 + 0.02 + 0.03 + 0.01 + 0.1)
    assert sum(cost.share(p) for p in PARTS) == pytest.approx(cost.share())
    assert cost.share() == pytest.approx(0.022) and not cost.within_budget
    line = cost.describe()
    assert line.startswith("resilience took 2.20% of the wall time") and "OVER" in line
    shown = [float(x) for x in re.findall(r"(\d+\.\d+)%", line.split(":", 1)[1])]
    assert sum(shown) == pytest.approx(2.20, abs=0.01)  # the parts shown add up too


def test_a_short_run_is_measured_over_its_one_step() -> None:
    cost = run_overhead(_records([5.0], [0.0]), budget=0.02, checkpoints_s=0.001)
    assert cost.wall_s == 0.1 and cost.share() == pytest.approx(0.01) and cost.within_budget
