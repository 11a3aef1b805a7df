"""The settings of a run, as one tree: `RunConfig` (how long, on which data, what is kept)
holds `ResilienceConfig` (how faults are detected, planned around and recovered from).
`rh.fit` and `resihp train` build them and hand them down unchanged (docs/api.md has each
field's account)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

from resihp_jax.env_vars import COMPILE_CACHE_ENV
from resihp_jax.errors import ConfigError
from resihp_jax.metrics.destinations import metrics_directory, parse_destinations
from resihp_jax.metrics.profile import check_steps
from resihp_jax.runtime.recovery.cadence import MAX_INTERVAL_S, check_interval

DETECTOR_OFF = "off"  # ResilienceConfig.detector: watch nothing (a failed step still re-plans)
# the detectors' registered names (detector/base.py DETECTORS, which tests/runtime/run/
# test_config_tree.py holds this to): named here because the command line builds this config
# before it may start JAX, and the detectors' package imports it
DETECTOR_NAMES = ("greyhound", "mad", "resihp")
OVERHEAD_BUDGET = 0.02  # the share of wall time resilience may take
# what ResilienceConfig.stage_timing_every's two kinds of value mean ('auto', an integer)
EVERY_MEANS = ("1 step in K, K from the measured cost and the overhead budget",
               "1 step in K; 1: every step")


def default_cache_dir() -> str:
    """JAX's persistent compilation cache: $RESIHP_COMPILE_CACHE, else the user's cache."""
    return os.environ.get(COMPILE_CACHE_ENV) or str(Path.home() / ".cache" / "resihp_jax" / "xla")


@dataclass(frozen=True)
class ResilienceConfig:
    """How the ResilientTrainer detects, re-plans and checkpoints (detector, policy, deadlines)."""
    detector: str = "resihp"
    policy: str = "resihp"
    # A step with no result by its deadline counts as hung (its busy devices stopped): the
    # deadline is `hang_factor` times the predicted healthy time of that very batch, at
    # least `hang_floor_s`; `step_timeout_s` until the cost model can predict (and the most a
    # step beside an asynchronous checkpoint write may get, see Checkpointer).
    step_timeout_s: float = 120.0
    hang_factor: float = 3.0
    hang_floor_s: float = 10.0
    # None: the devices' own memory where they report it (GPUs), else 4 GB (CPU devices)
    device_memory_gb: float | None = None
    recompile_s: float = 10.0  # charged for a new mesh until a compile has been measured
    horizon_s: float = 3600.0  # expected seconds to the next failure
    checkpoint_dir: str | None = None
    # 'auto': Young's interval from a save's measured cost and the mtbf (recovery/cadence.py);
    # an integer: every N steps. A save due while the last write still goes is put off
    checkpoint_interval: int | str = "auto"
    # the job's expected seconds between failures (None: 50,000 GPU-hours over its devices)
    mtbf_s: float | None = None
    max_checkpoint_interval_s: float = MAX_INTERVAL_S  # the most training a failure may lose
    # the share of wall time checkpoints' blocking, probes and stage timing may take
    # together; the run reports what they took (FitResult.overhead)
    overhead_budget: float = OVERHEAD_BUDGET
    local_copy_dir: str | None = None  # node-local survivors' copies (recovery/local_copies.py)
    precompile: int = 4  # programs of likely next plans compiled in the background (0: off)
    # after a fail-slow verdict, train an interim split while a new mesh compiles in the
    # background instead of stalling for the compile; and after the first step, compile the
    # layout moves (checkpoints, re-plans) in the background. False: both compile when needed
    background_compile: bool = True
    # the step carries the host callbacks that time each stage (the detector localizes by
    # them, a hung step names its device, injected faults act through them). False: never
    # (step times only; no fault_hook)
    stage_timing: bool = True
    # which steps carry them: 'auto' 1 in K within a quarter of `overhead_budget` (every step
    # while the detector is in doubt); K: every K-th (runtime/trainer/sampling.py)
    stage_timing_every: int | str = "auto"
    # JAX's persistent compilation cache (None: off). It holds every program without host
    # callbacks (state moves, the step when no instrument is attached): JAX never persists
    # an executable that calls back into Python.
    compile_cache_dir: str | None = field(default_factory=default_cache_dir)
    # With the cache on: start on the untimed step (a relaunch onto a plan the job ran loads
    # it instead of compiling) while the stage-timed one compiles in the background; until
    # it takes over a hung step names no device. None: in a job of several processes only
    # (a hung step restarts the job anyway; one process re-plans around the device named).
    untimed_start: bool | None = None
    # Run each prepared program once in the background on a zero state (step/warmup.py): a
    # switch onto its mesh pays no first-run setup. Off by default: meanwhile it holds a
    # second state and activations on devices the running step shares (GPUs). One process
    # only (its collectives would interleave with the step's across processes).
    warm_prepared: bool = False

    def __post_init__(self) -> None:
        for name in ("step_timeout_s", "hang_floor_s", "device_memory_gb", "horizon_s"):
            if not (getattr(self, name) is None and name == "device_memory_gb") and \
                    not getattr(self, name) > 0:
                raise ConfigError(f"ResilienceConfig.{name}={getattr(self, name)!r}: must be > 0")
        if not math.isfinite(self.step_timeout_s) or self.step_timeout_s < self.hang_floor_s:
            raise ConfigError(f"ResilienceConfig.step_timeout_s={self.step_timeout_s!r} "
                              f"(--step-timeout-s): must be >= hang_floor_s={self.hang_floor_s!r} "
                              "(--hang-floor-s): no step deadline is below the floor")
        if not self.hang_factor > 1:
            raise ConfigError(f"ResilienceConfig.hang_factor={self.hang_factor!r}: must be > 1 "
                              "(a step slower than predicted is not yet hung)")
        for name in ("warm_prepared", "background_compile", "stage_timing"):
            if getattr(self, name) not in (True, False):
                raise ConfigError(f"ResilienceConfig.{name}={getattr(self, name)!r}: must be "
                                  "True or False")
        if self.detector != DETECTOR_OFF and self.detector not in DETECTOR_NAMES:
            raise ConfigError(f"ResilienceConfig.detector={self.detector!r}: valid are "
                              f"{', '.join(DETECTOR_NAMES)}, {DETECTOR_OFF!r} (none)")
        if self.untimed_start not in (None, True, False):
            raise ConfigError(f"ResilienceConfig.untimed_start={self.untimed_start!r}: must be "
                              "True, False or None (in a job of several processes only)")
        if not self.recompile_s >= 0 or self.precompile < 0:
            raise ConfigError(f"ResilienceConfig: recompile_s={self.recompile_s!r} must be >= 0 "
                              f"and precompile={self.precompile!r} >= 0")
        check_interval(self.checkpoint_interval, "ResilienceConfig.checkpoint_interval")
        check_interval(self.stage_timing_every, "ResilienceConfig.stage_timing_every",
                       EVERY_MEANS)
        if self.mtbf_s is not None and not self.mtbf_s > 0:
            raise ConfigError(f"ResilienceConfig.mtbf_s={self.mtbf_s!r}: must be > 0 seconds "
                              "or None (50,000 GPU-hours over the job's devices)")
        if not self.max_checkpoint_interval_s > 0:
            raise ConfigError(f"ResilienceConfig.max_checkpoint_interval_s="
                              f"{self.max_checkpoint_interval_s!r}: must be > 0")
        if not 0 < self.overhead_budget < 1:
            raise ConfigError(f"ResilienceConfig.overhead_budget={self.overhead_budget!r}: "
                              "must be a share of wall time between 0 and 1 (e.g. 0.02)")

    @classmethod
    def unwatched(cls, **settings: Any) -> ResilienceConfig:
        """Nothing watched: no detector, probes or stage timing, nothing compiled ahead (what
        `resihp train` runs without --adapt). The loop still learns each step's deadline,
        checkpoints, keeps copies and survives a failed step."""
        return cls(**{"detector": DETECTOR_OFF, "stage_timing": False, "precompile": 0,
                      **settings})

    def replace(self, **changes: Any) -> ResilienceConfig:
        return dataclasses.replace(self, **changes)

    @property
    def watching(self) -> bool:
        """Does a detector watch the steps (re-planning around slow devices in place)?"""
        return self.detector != DETECTOR_OFF


SURVIVOR_COPY_MODES = ("auto", "keep", "host", "off")
# RunConfig.resume: continue even from another run's state (a changed model, optimizer, data
# or batch shape), saying what differed; on purpose only
RESUME_FORCE = "force"


@dataclass(frozen=True)
class RunConfig:
    """One run: how long it trains, on which data, what it reports, and (`resilience`) how it
    detects, re-plans, checkpoints and recovers. Frozen, validated on construction."""
    steps: int = 20  # train until this step, counted from the start of the run
    seed: int = 0  # seed of the weights and the data
    data: str = "synthetic:lognormal"  # synthetic:uniform|lognormal|bimodal, corpus[:PATH]
    # continue from the newest good state in resilience.checkpoint_dir (refused when another
    # run wrote it, see recovery/run_identity.py); RESUME_FORCE: continue even then
    resume: bool | str = False
    # how each process keeps the last completed step for a relaunch: auto picks keep where
    # two more states fit in device memory, else host (see recovery/host_copies.py)
    survivor_copies: str = "auto"
    # where process 0 writes the metrics: tensorboard:DIR, wandb:PROJECT, jsonl:PATH or a
    # path (one JSON line per step), an object with write(entry), or a sequence of them
    metrics: Any = None
    # a jax.profiler trace of steps (first, end) (end excluded) into the metrics directory
    profile_steps: tuple[int, int] | None = None
    progress: bool = True  # a progress bar on process 0
    devices: int | None = None  # one process: devices to use (default: the plan's count)
    # the detector, scheduler, deadlines and checkpoints; by default nothing watched and no
    # compile cache (`resihp train` without --adapt)
    resilience: ResilienceConfig = field(
        default_factory=lambda: ResilienceConfig.unwatched(compile_cache_dir=None))

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"RunConfig.steps={self.steps!r}: must be >= 1")
        if not isinstance(self.resilience, ResilienceConfig):
            raise ConfigError(f"RunConfig.resilience: expected a ResilienceConfig, got "
                              f"{type(self.resilience).__name__}")
        if self.survivor_copies not in SURVIVOR_COPY_MODES:
            raise ConfigError(f"RunConfig.survivor_copies={self.survivor_copies!r}: valid are "
                              f"{', '.join(SURVIVOR_COPY_MODES)}")
        directory = self.resilience.checkpoint_dir
        if self.resilience.local_copy_dir is not None and (directory is None
                                                           or self.survivor_copies == "off"):
            raise ConfigError(f"ResilienceConfig.local_copy_dir="
                              f"{self.resilience.local_copy_dir!r} needs a checkpoint_dir and "
                              "RunConfig.survivor_copies other than 'off'")
        if self.resume not in (False, True, RESUME_FORCE):
            raise ConfigError(f"RunConfig.resume={self.resume!r}: valid are False, True and "
                              f"{RESUME_FORCE!r} (continue even from another run's state)")
        if self.resume and directory is None:
            raise ConfigError("RunConfig.resume needs ResilienceConfig.checkpoint_dir")
        check_metrics(self.metrics, self.profile_steps, "RunConfig.")
        if self.devices is not None and self.devices < 1:
            raise ConfigError(f"RunConfig.devices={self.devices}: must be >= 1 or None")

    @property
    def checkpoint_dir(self) -> str | None:  # `resilience.checkpoint_dir`, read in many places
        return self.resilience.checkpoint_dir


def check_metrics(metrics: Any, profile_steps: Any, prefix: str = "") -> None:
    """ConfigError, naming `prefix`metrics or `prefix`profile_steps, for a destination that
    is not one (or whose library is missing) or steps to profile with nowhere to write."""
    destinations = parse_destinations(metrics, f"{prefix}metrics")
    if check_steps(profile_steps, f"{prefix}profile_steps") is not None and \
            metrics_directory(destinations) is None:
        raise ConfigError(f"{prefix}profile_steps={profile_steps!r}: the trace is written into "
                          "the metrics directory: give metrics='tensorboard:DIR' too")
