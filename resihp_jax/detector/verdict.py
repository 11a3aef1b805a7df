"""Values the detectors exchange: one observed step in, one verdict out."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan

KINDS = ("compute", "link", "stopped")


@dataclass(frozen=True)
class HostCpu:
    """CPU use on the step's host while it ran, in cores (CPU seconds per second of step)."""
    own: float  # this process, every thread
    others: float  # every other process, and what the hypervisor gave other guests (steal)
    cores: int  # the host's cores
    # these cores run every device of the job (one process): cores running slower then slow
    # every device alike, so this process's extra CPU seconds are the machine's, not a device's
    every_device: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.own) and math.isfinite(self.others)) or self.cores < 1:
            raise ConfigError(f"HostCpu(own={self.own!r}, others={self.others!r}, "
                              f"cores={self.cores!r}): need finite loads and cores >= 1")


@dataclass(frozen=True, eq=False)
class StepObservation:
    """What the runtime saw for one step: its plan, its exact batch and its host time."""
    step: int
    plan: Plan
    mb_tokens: np.ndarray  # [M] tokens of each global micro-batch
    mb_sum_l2: np.ndarray  # [M] sum of l_i^2 of each global micro-batch
    step_time_s: float
    # [dp, pp] when measured: forward time of each group's first micro-batch through each
    # stage's layers (what the train step's Instrument times; StepSim.timed_fwd_s)
    stage_times_s: np.ndarray | None = None
    # when measured: what this process and the others on its host ran meanwhile (a load
    # the host explains is not a slow device); runtime/trainer/host_cpu.py
    host_cpu: HostCpu | None = None

    def __post_init__(self) -> None:
        t = self.step_time_s
        if isinstance(t, bool) or not isinstance(t, (int, float, np.floating)) or \
                not math.isfinite(t) or t <= 0:
            raise ConfigError(f"StepObservation.step_time_s={t!r}: must be a finite time > 0")
        m = self.plan.n_microbatches
        for name in ("mb_tokens", "mb_sum_l2"):
            arr = np.asarray(getattr(self, name), dtype=np.float64)
            if arr.size == 0:
                raise ConfigError(f"StepObservation.{name} is empty: a step needs its batch's "
                                  f"{m} micro-batches")
            if arr.shape != (m,) or not np.isfinite(arr).all() or (arr < 0).any():
                raise ConfigError(f"StepObservation.{name}={arr.tolist()}: need {m} finite "
                                  "values >= 0 (one per micro-batch of the plan)")
            object.__setattr__(self, name, arr)
        if self.mb_tokens.sum() <= 0:
            raise ConfigError("StepObservation.mb_tokens sums to 0: the batch is empty")


@dataclass(frozen=True)
class Verdict:
    """A detector's conclusion: which devices, what kind of fault, how slow, how sure."""
    step: int
    devices: tuple[int, ...]
    kind: str  # one of KINDS
    slowdown: float  # estimated factor (>= 1; inf for stopped)
    confidence: float  # in [0, 1]
    detector: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"Verdict.kind={self.kind!r}: valid are {', '.join(KINDS)}")
        if not 0.0 <= self.confidence <= 1.0:
            raise ConfigError(f"Verdict.confidence={self.confidence!r}: must be in [0, 1]")
