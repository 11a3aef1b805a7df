"""What resilience cost a run: its parts' seconds against the run's wall time and its budget.

Resilience is paid for while nothing fails, so a run accounts for the seconds its step loop
was blocked in each part (PARTS: checkpoint saves, the detector's judgement, its probes, the
stage-timing callbacks and CPU counters, the survivors' host copies, and where metrics are
written their hand-over and writes), each measured where it is spent, against wall time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence


PARTS = ("checkpoints", "detector", "probes", "timing", "copies", "metrics")


@dataclass(frozen=True)
class Overhead:
    """Seconds per part (PARTS) over `wall_s` seconds of training; `budget`: the share of
    wall time they were allowed together (ResilienceConfig.overhead_budget)."""
    seconds: Mapping[str, float]
    wall_s: float
    budget: float
    counts: Mapping[str, int] = field(default_factory=dict)  # e.g. saves, probe runs
    # the checkpointer's own account (recovery/checkpoint.py SaveStats.as_dict): blocking
    # and write seconds, saves put off, waits on a previous write, each write's steps
    checkpoint: Mapping[str, Any] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return float(sum(self.seconds.values()))

    def share(self, part: str | None = None) -> float:
        """Part `part`'s share of the wall time (None: all parts together)."""
        spent = self.total_s if part is None else self.seconds.get(part, 0.0)
        return spent / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def within_budget(self) -> bool:
        return self.share() <= self.budget

    def describe(self) -> str:
        parts = ", ".join(f"{p} {100 * self.share(p):.2f}%" for p in PARTS
                          if p in self.seconds)
        verdict = "within" if self.within_budget else "OVER"
        return (f"resilience took {100 * self.share():.2f}% of the wall time "
                f"({self.total_s:.2f} s of {self.wall_s:.1f} s; {verdict} its "
                f"{100 * self.budget:g}% budget): {parts}")

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": {p: round(s, 6) for p, s in self.seconds.items()},
                "total_s": round(self.total_s, 6), "wall_s": round(self.wall_s, 6),
                "share": round(self.share(), 6), "budget": self.budget,
                "counts": dict(self.counts), "checkpoint": dict(self.checkpoint)}


def run_overhead(records: Sequence[Any], *, budget: float, checkpoints_s: float = 0.0,
                 detector_s: float = 0.0, probes_s: float = 0.0, timing_s: float = 0.0,
                 counts: Mapping[str, int] | None = None,
                 checkpoint: Mapping[str, Any] | None = None,
                 metrics_s: float | None = None) -> Overhead:
    """The run's Overhead from its records (their host copies after the first step) and the
    seconds each other part measured."""
    copies = float(sum(r.host_copy_s for r in records[1:]))
    seconds = {"checkpoints": checkpoints_s, "detector": detector_s, "probes": probes_s,
               "timing": timing_s, "copies": copies}
    if metrics_s is not None:  # (a part only where metrics are written)
        seconds["metrics"] = metrics_s
    # training's wall time: from the end of the first (compiling) step to the end of the last
    # (everything between steps counts); the one step's time when there is one
    wall_s = (float(records[-1].end_unix_s - records[0].end_unix_s) if len(records) >= 2
              else float(records[0].step_time_s) if records else 0.0)
    return Overhead(seconds, wall_s, budget, dict(counts or {}), dict(checkpoint or {}))
