"""A benchmark's correctness invariants and its exit code.

Invariants are facts that hold on any machine, however fast or loaded: the fault fired and
the job survived it, every step trained exactly once and on the right batch, the losses equal
the uninterrupted run's within the stated tolerance, no step lost, no compile where a re-plan
promises none. Timing and quality targets (false alarms, MAPE, speed ratios, seconds) are not
invariants: they stay in a benchmark's table and JSON line, never in its exit code.

Every benchmark puts its invariants under "invariants" in its final JSON line (name -> bool)
and returns `verdict(...)`: 0 when all hold, else 1, with one line on stderr per broken one.
The checks are pure functions of what a run recorded, so a unit test can break a record (a
step skipped, a loss off, a fault that never fired) and see the verdict turn.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TextIO


def verdict(invariants: Mapping[str, bool], details: Mapping[str, object] | None = None,
            name: str = "benchmark", err: TextIO | None = None) -> int:
    """The exit code of a benchmark whose invariants are `invariants`: 1 if any is false
    (each named on `err`, default stderr, with `details[key]` where given), else 0."""
    err = sys.stderr if err is None else err
    broken = [key for key, held in invariants.items() if not held]
    for key in broken:
        what = details.get(key) if details else None
        print(f"{name}: invariant {key} broken" + ("" if what is None else f": {what}"),
              file=err)
    return 1 if broken else 0


def every_step_once(steps: Iterable[int], n_steps: int | None = None, first: int = 1) -> bool:
    """The recorded steps, in order, are first, first+1, ... (n_steps of them where given):
    none skipped, none repeated."""
    steps = list(steps)
    want = len(steps) if n_steps is None else n_steps
    return want > 0 and steps == list(range(first, first + want))


def step_gaps(steps: Iterable[int], n_steps: int, first: int = 1) -> str:
    """What is wrong with a step sequence against first..first+n_steps-1 (for the message)."""
    steps = list(steps)
    want = set(range(first, first + n_steps))
    missing = sorted(want - set(steps))
    repeated = sorted({s for s in steps if steps.count(s) > 1})
    extra = sorted(set(steps) - want)
    parts = [f"{label} {values[:8]}" for label, values in
             (("missing", missing), ("repeated", repeated), ("unexpected", extra)) if values]
    if not parts and steps != sorted(steps):
        parts.append("out of order")
    return ", ".join(parts) or "in order"


def max_rel_diff(losses: Sequence[float], reference: Sequence[float]) -> float:
    """The largest relative difference of `losses` from `reference`, step by step; inf when
    their lengths differ or either is empty (a run that lost or gained steps is not equal),
    NaN losses count as inf."""
    if len(losses) != len(reference) or not losses:
        return math.inf
    worst = 0.0
    for a, b in zip(losses, reference):
        diff = abs(a - b) / abs(b) if b else abs(a - b)
        if math.isnan(diff):
            return math.inf
        worst = max(worst, diff)
    return worst


def losses_equal(losses: Sequence[float], reference: Sequence[float], rtol: float) -> bool:
    """Every loss within relative `rtol` of the reference's for the same step, and as many."""
    return max_rel_diff(losses, reference) <= rtol


def batches_match(crcs: Sequence[int], reference: Sequence[int]) -> bool:
    """Each step trained the reference's batch for that step (its tokens' CRC), no more, no
    fewer: none skipped, none repeated, none out of place."""
    return len(crcs) > 0 and list(crcs) == list(reference)
