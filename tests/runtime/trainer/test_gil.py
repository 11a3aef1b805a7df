"""The step loop's hold on the interpreter's lock (runtime/trainer/resilient.py
`responsive_loop`); what it buys is timed in benchmarks/gil_contention.py, not here."""

from __future__ import annotations

import sys

import pytest

from resihp_jax.runtime.trainer.resilient import SWITCH_INTERVAL_S, responsive_loop


def test_the_loop_takes_the_short_interval_and_gives_the_old_one_back_even_on_error() -> None:
    before = sys.getswitchinterval()
    assert before > SWITCH_INTERVAL_S  # (the interpreter's 5 ms: else nothing to show)
    with pytest.raises(RuntimeError), responsive_loop():
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        with responsive_loop(1.0):  # nested: never made longer than it is
            assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        raise RuntimeError("a step failed")
    assert sys.getswitchinterval() == before
