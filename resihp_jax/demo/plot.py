"""The demo's timeline figure: observed against predicted healthy step time, faults,
verdicts and re-plans marked. matplotlib is imported only when a figure is saved, through its
object API with the Agg canvas (no pyplot, no global backend switch): headless nodes work.
"""

from __future__ import annotations

from pathlib import Path

from resihp_jax.demo.scenario import Fault, KillSpec
from resihp_jax.demo.summary import ReplanPoint, StepPoint

PLOT_SUFFIXES = (".png", ".pdf", ".svg")
_BOX = {"facecolor": "white", "alpha": 0.75, "edgecolor": "none", "pad": 1.0}


def _segments(points: list[StepPoint]) -> list[tuple[int, int, str]]:
    """(first x, last x, plan) of each run of steps under one plan; x counts steps as run."""
    out: list[tuple[int, int, str]] = []
    for x, p in enumerate(points, 1):
        if out and out[-1][2] == p.plan:
            out[-1] = (out[-1][0], x, p.plan)
        else:
            out.append((x, x, p.plan))
    return out


def _onset_x(points: list[StepPoint], fault: Fault, replans: list[ReplanPoint]) -> float | None:
    if isinstance(fault, KillSpec):  # the failed step never ran: mark where it was tried
        hit = next((r for r in replans if r.kind == "stopped" and fault.device in r.devices
                    and r.step >= fault.step), None)
        if hit is not None:
            return hit.at + 0.5
    return next((x - 0.5 for x, p in enumerate(points, 1) if p.step >= fault.step), None)


def save_timeline(points: list[StepPoint], replans: list[ReplanPoint], faults: list[Fault],
                  path: str, title: str) -> None:
    """Write the figure to `path` (format from its suffix: .png, .pdf or .svg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = list(range(1, len(points) + 1))
    ax.plot(xs, [p.step_time_s for p in points], ".-", color="tab:blue", lw=1,
            label="observed step time")
    predicted = [float("nan") if p.predicted_s is None else p.predicted_s for p in points]
    ax.plot(xs, predicted, "-", color="tab:gray", lw=1.5, alpha=0.8,
            label="predicted healthy time (this batch, this plan)")
    ax.set_yscale("log")  # first steps of a plan compile: seconds beside ~0.1 s steps
    _mark_segments(ax, points)
    _mark_events(ax, points, replans, faults)
    ax.set_xlabel("steps run (a step re-run after a checkpoint restore counts again)")
    ax.set_ylabel("step time (s, log scale)")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[*ax.get_lines()[:2], *_event_keys()], loc="upper left", fontsize=8)
    fig.savefig(Path(path), dpi=110)


def _event_keys() -> list:
    from matplotlib.lines import Line2D

    return [Line2D([], [], color="tab:red", ls="--", label="fault injected"),
            Line2D([], [], color="tab:green", label="verdict and re-plan"),
            Line2D([], [], color="tab:orange", label="verdict, plan kept")]


def _mark_segments(ax, points: list[StepPoint]) -> None:  # noqa: ANN001 - a matplotlib Axes
    for i, (lo, hi, plan) in enumerate(_segments(points)):
        if i % 2:
            ax.axvspan(lo - 0.5, hi + 0.5, color="0.93", zorder=0)
        ax.text((lo + hi) / 2, 0.02, plan.replace(" ", "\n"), transform=ax.get_xaxis_transform(),
                ha="center", va="bottom", fontsize=7, color="0.25")


def _mark_events(ax, points: list[StepPoint], replans: list[ReplanPoint],  # noqa: ANN001
                 faults: list[Fault]) -> None:
    for fault in faults:
        x = _onset_x(points, fault, replans)
        if x is not None:
            ax.axvline(x, color="tab:red", ls="--", lw=1.2)
            ax.text(x, 0.97, f" {fault.describe()}", transform=ax.get_xaxis_transform(),
                    color="tab:red", fontsize=8, rotation=90, ha="right", va="top", bbox=_BOX)
    for r in replans:
        color = "tab:green" if r.changed else "tab:orange"
        ax.axvline(r.at + 0.5, color=color, lw=1.2)
        what = f"{r.kind} {r.slowdown:.1f}x" if r.kind != "stopped" else "stopped"
        act = "re-plan" if r.changed else "plan kept"
        ax.text(r.at + 0.5, 0.97, f" step {r.step}: {r.detector} verdict {list(r.devices)} "
                f"{what}; {act}", transform=ax.get_xaxis_transform(), color=color,
                fontsize=8, rotation=90, ha="left", va="top", bbox=_BOX)
