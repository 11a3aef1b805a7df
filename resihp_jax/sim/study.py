"""A study: every policy through the same seeded traces of one (size, scenario), summarised
as a mean over seeds with its spread (sample standard deviation)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from resihp_jax.errors import ConfigError
from resihp_jax.sim.cluster import get_cluster, nominal_plan
from resihp_jax.sim.events import POLICIES, RunResult, simulate
from resihp_jax.sim.traces import get_scenario, make_trace

METRICS = ("goodput", "running_throughput", "stall_s_per_failure", "false_alarm_stall_s",
           "switch_stall_s", "n_failures")


@dataclass(frozen=True)
class StudyConfig:
    n_gpus: int
    scenario: str
    days: float = 7.0
    seeds: int = 5
    policies: tuple[str, ...] = tuple(POLICIES)

    def __post_init__(self) -> None:
        from resihp_jax.models.config import get_model_config

        nominal_plan(self.n_gpus, get_model_config("llama2-70b"))  # validates the size
        get_scenario(self.scenario)
        if not (isinstance(self.days, (int, float)) and 0 < self.days <= 365):
            raise ConfigError(f"days={self.days!r}: must be in (0, 365]")
        if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 1:
            raise ConfigError(f"seeds={self.seeds!r}: must be an integer >= 1")
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown or not self.policies:
            raise ConfigError(f"policies={list(self.policies)}: valid are {', '.join(POLICIES)}")


@dataclass(frozen=True)
class Study:
    config: StudyConfig
    runs: dict[str, list[RunResult]]  # policy -> one result per seed

    def mean(self, policy: str, metric: str) -> float:
        values = [getattr(r, metric) for r in self.runs[policy]]
        finite = [v for v in values if not math.isnan(v)]
        return float(np.mean(finite)) if finite else math.nan

    def spread(self, policy: str, metric: str) -> float:
        values = [v for v in (getattr(r, metric) for r in self.runs[policy])
                  if not math.isnan(v)]
        return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def run_study(config: StudyConfig, tick: Callable[[], None] | None = None,
              record_seed: int | None = 0) -> Study:
    """Every policy on every seed's trace; `tick()` after each (policy, seed) run."""
    cm = get_cluster(config.n_gpus)
    scenario = get_scenario(config.scenario)
    duration = config.days * 86400.0
    runs: dict[str, list[RunResult]] = {p: [] for p in config.policies}
    for seed in range(config.seeds):
        trace = make_trace(scenario, config.n_gpus, duration, seed)
        for name in config.policies:
            runs[name].append(simulate(name, cm, trace, scenario.stop_rate_per_s(cm.n_gpus),
                                       seed, record=seed == record_seed))
            if tick is not None:
                tick()
    return Study(config, runs)


def summary(study: Study, policies: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    """Policy -> metric means (and goodput's spread), for the JSON line."""
    out = {}
    for name in policies or study.config.policies:
        cell = {m: _round(study.mean(name, m)) for m in METRICS}
        cell["goodput_std"] = _round(study.spread(name, "goodput"))
        out[name] = cell
    return out


def _round(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)
