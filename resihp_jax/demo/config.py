"""What one demo run is, checked on creation, before any device starts (no JAX import).

The checks shared with the command line take the name to report, so each caller's message
names what its user typed (a flag or a field).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from resihp_jax.demo.plot import PLOT_SUFFIXES
from resihp_jax.demo.scenario import Fault, KillSpec, SlowSpec, check_fault_range
from resihp_jax.models.registry import Entry, check_plan
from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan
from resihp_jax.metrics.destinations import parse_destinations


@dataclass(frozen=True)
class DemoConfig:
    """One demo run: the model and starting plan, the injected faults, and what to write."""
    model: Entry  # a registry model: a Llama preset or gpt2 (models/registry.py)
    plan: Plan  # the starting mesh, its split and the batch shape (micro-batches, seq_len)
    n_devices: int  # the pool: more than the plan needs leaves spares for re-plans
    steps: int
    slow: SlowSpec | None = None
    kill: KillSpec | None = None
    seed: int = 0  # of the parameters and the data order
    data: str = "corpus"  # a data source spec, checked when the data iterator is built
    plot: str | None = None  # the timeline figure (.png, .pdf or .svg; None: no figure)
    metrics: str | None = None  # one JSON object per step and per event (None: none)
    # other metrics destinations (tensorboard:DIR, wandb:PROJECT; resihp_jax/metrics)
    dashboards: tuple[str, ...] = ()
    checkpoint_dir: str | None = None  # None: a stopped device's state moves in memory
    precompile: int = 4  # programs of likely next plans compiled in the background (0: off)
    background_compile: bool = True  # train an interim split while a new mesh compiles
    progress: bool = True  # a bar on a terminal, else a line every few steps
    compile_cache: str | None = None  # JAX's persistent compilation cache (None: off)

    def __post_init__(self) -> None:
        check_at_least(self.steps, 1, "steps")
        check_at_least(self.seed, 0, "seed")
        check_at_least(self.precompile, 0, "precompile")
        check_plot_name(self.plot, "plot", off="None")
        check_two_files(self.plot, self.metrics, ("plot", "metrics"))
        parse_destinations(self.dashboards, "dashboards")
        if self.n_devices < self.plan.n_devices:
            raise ConfigError(f"n_devices={self.n_devices}: the plan {self.plan.describe()} "
                              f"needs dp*pp*tp={self.plan.n_devices} devices")
        check_plan(self.model, self.plan, "plan")
        self.plan.check(self.model, range(self.n_devices))
        check_fault_range(self.slow, self.kill, steps=self.steps,
                          plan_devices=self.plan.device_ids)

    @property
    def faults(self) -> list[Fault]:
        return [f for f in (self.slow, self.kill) if f is not None]


def check_at_least(value: int, low: int, name: str) -> None:
    if value < low:
        raise ConfigError(f"{name}={value}: must be >= {low}")


def check_plot_name(plot: str | None, name: str, off: str) -> None:
    """The figure's format comes from its suffix; `off` is how the caller says 'no figure'."""
    if plot is not None and not plot.lower().endswith(PLOT_SUFFIXES):
        raise ConfigError(f"{name}={plot!r}: the file name must end in "
                          f"{', '.join(PLOT_SUFFIXES)} (or give {off})")


def check_two_files(plot: str | None, metrics: str | None, names: tuple[str, str]) -> None:
    """The metrics are written while training and the figure after it: one file would hold
    only the figure."""
    if plot is not None and metrics is not None and \
            Path(plot).absolute() == Path(metrics).absolute():
        raise ConfigError(f"{names[0]} and {names[1]} are both {plot!r}: give two files")
