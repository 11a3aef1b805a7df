"""When a run saves: every N steps, or `auto`: an interval in seconds from what a save costs.

`auto` follows Young's rule, T = sqrt(2 C M), C this run's measured blocking cost of one save,
M the job's expected time between failures, bounded as `choose_interval` says. The seconds
must not split a job of several processes (each process's clock reads differently): process
0 turns them into the step of the next save once per save and every process takes that
number, so between saves the decision is a comparison of step numbers, with no message.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import median_high
from typing import Callable

from resihp_jax.errors import ConfigError

AUTO = "auto"
# Llama 3's 16,384-GPU run: 419 interruptions in 54 days, about 50,000 GPU-hours between
# interruptions per GPU
GPU_MTBF_S = 50_000 * 3600.0
MAX_INTERVAL_S = 30 * 60.0  # at most this much training lost to a fail-stop by default
# before any save was measured: the first save falls due after this much training (its cost
# is what every later interval is computed from)
FIRST_SAVE_S = 60.0
STEP_GAPS = 50  # the step time is the median gap over this many recent steps
# what 'auto' and an integer mean as a checkpoint interval (check_interval's message)
INTERVAL_MEANS = ("an interval in seconds from a save's measured cost",
                  "a save every that many steps")


def check_interval(interval: object, where: str,
                   means: tuple[str, str] = INTERVAL_MEANS) -> int | str:
    """`interval` if it is 'auto' or an integer >= 1; else ConfigError naming `where` and
    what 'auto' and an integer `means` there (the stage timing's 1 step in K too)."""
    if interval == AUTO:
        return AUTO
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ConfigError(f"{where}={interval!r}: give 'auto' ({means[0]}) or an integer "
                          f">= 1 ({means[1]})")
    return interval


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval for a blocking cost `cost_s` and MTBF `mtbf_s`."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def job_mtbf_s(n_devices: int, per_device_s: float = GPU_MTBF_S) -> float:
    """The job's expected seconds between failures: any one of its devices failing ends it."""
    return per_device_s / max(1, n_devices)


@dataclass(frozen=True)
class Choice:
    """An `auto` interval and what set it."""
    interval_s: float
    young_s: float
    cost_s: float
    write_s: float
    mtbf_s: float
    bound: str  # young | budget | write | ceiling

    def describe(self) -> str:
        why = {"young": "Young's sqrt(2 C M)",
               "budget": "C / the resilience budget (above Young's sqrt(2 C M))",
               "write": "the background write's time (Young's is shorter)",
               "ceiling": "the ceiling on lost work (Young's is longer)"}[self.bound]
        return (f"every {self.interval_s:,.1f} s, from {why}: C={self.cost_s:.3f} s blocking "
                f"per save, background write {self.write_s:.2f} s, M={self.mtbf_s / 3600:,.1f} h "
                f"for the job, Young {self.young_s:,.1f} s")


def choose_interval(cost_s: float, write_s: float, mtbf_s: float, *,
                    max_interval_s: float = MAX_INTERVAL_S,
                    budget: float | None = None) -> Choice:
    """The `auto` interval: Young's, at least C / `budget` (the blocking stays within the
    budget), at most `max_interval_s`, and never shorter than the background write
    (`write_s`: saves due faster than the disk takes them would only be put off)."""
    young = young_interval_s(cost_s, mtbf_s)
    interval, bound = young, "young"
    if budget is not None and cost_s / budget > interval:
        interval, bound = cost_s / budget, "budget"
    if interval > max_interval_s:
        interval, bound = max_interval_s, "ceiling"
    if write_s > interval:
        interval, bound = write_s, "write"
    return Choice(interval, young, cost_s, write_s, mtbf_s, bound)


class Cadence:
    """Which steps save. `interval`: steps (int), or 'auto' (see the module doc).

    The caller agrees on `plan_next`'s proposal (when `needs_plan`) and sets it with
    `set_next`; `saved` and `wrote` feed the measurements.
    """

    def __init__(self, interval: int | str, *, mtbf_s: float,
                 max_interval_s: float = MAX_INTERVAL_S, budget: float | None = None,
                 first_save_s: float = FIRST_SAVE_S, clock: Callable[[], float]) -> None:
        self.interval = check_interval(interval, "checkpoint interval")
        for name, value in (("mtbf_s", mtbf_s), ("max_interval_s", max_interval_s),
                            ("first_save_s", first_save_s)):
            if not value > 0:
                raise ConfigError(f"checkpoint cadence {name}={value!r}: must be > 0")
        self.mtbf_s, self.max_interval_s, self.budget = mtbf_s, max_interval_s, budget
        self.first_save_s = first_save_s
        self._clock = clock
        self._ends: deque[float] = deque(maxlen=STEP_GAPS + 1)
        self._last_step: int | None = None
        self.next_due: int | None = None  # auto: the step of the next save, once planned
        self.costs_s: list[float] = []  # blocking seconds of each save
        self.writes_s: list[float] = []  # background seconds of each write seen to end
        self.choice: Choice | None = None  # the newest auto interval

    @property
    def auto(self) -> bool:
        return self.interval == AUTO

    def step_ended(self, step: int) -> None:
        if self._last_step is not None and step != self._last_step + 1:
            self._ends.clear()  # a resume or a re-run: the gap is not one step's
        self._last_step = step
        self._ends.append(self._clock())

    def step_s(self) -> float | None:
        """The median wall time between recent step ends (everything between steps counts)."""
        ends = list(self._ends)
        if len(ends) < 2:
            return None
        return median_high(b - a for a, b in zip(ends, ends[1:]))

    def due(self, step: int) -> bool:
        if not self.auto:
            return step % int(self.interval) == 0
        return self.next_due is not None and step >= self.next_due

    def needs_plan(self) -> bool:
        return self.auto and self.next_due is None and self.step_s() is not None

    def plan_next(self, step: int) -> int:
        """The step at which the next save falls due, counted from `step` (auto only)."""
        seconds = self.first_save_s
        if self.costs_s:
            self.choice = choose_interval(
                median_high(self.costs_s[-5:]), max(self.writes_s, default=0.0), self.mtbf_s,
                max_interval_s=self.max_interval_s, budget=self.budget)
            seconds = self.choice.interval_s
        step_s = self.step_s() or seconds
        return step + max(1, math.ceil(seconds / max(step_s, 1e-9)))

    def set_next(self, step: int) -> None:
        self.next_due = int(step)

    def saved(self, cost_s: float) -> None:
        self.costs_s.append(cost_s)
        if self.auto:
            self.next_due = None  # planned again from the costs measured so far

    def wrote(self, write_s: float) -> None:
        self.writes_s.append(write_s)
