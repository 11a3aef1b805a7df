"""RunConfig: what one training run does beyond the model, the optimizer and the plan.

How long it trains, on which data, where its state is kept and how it recovers. `resihp
train` builds one from its flags; a script builds the same one and runs exactly what the
command runs (`TrainingRun`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from resihp_jax.errors import ConfigError
from resihp_jax.metrics.destinations import metrics_directory, parse_destinations
from resihp_jax.metrics.profile import check_steps
from resihp_jax.runtime.job.deadline import Ladder
from resihp_jax.runtime.recovery.cadence import AUTO, check_interval

SURVIVOR_COPY_MODES = ("auto", "keep", "host", "off")
DEFAULT_CHECKPOINT_EVERY = AUTO
# RunConfig.resume: continue even from another run's state (a changed model, optimizer, data
# or batch shape), saying what differed; on purpose only
RESUME_FORCE = "force"


@dataclass(frozen=True)
class RunConfig:
    """One run's length, data and recovery settings (frozen, validated on construction)."""
    steps: int = 20  # train until this step, counted from the start of the run
    seed: int = 0  # seed of the weights and the data
    data: str = "synthetic:lognormal"  # synthetic:uniform|lognormal|bimodal, corpus[:PATH]
    checkpoint_dir: str | None = None  # orbax checkpoints, health record, survivors' copies
    # steps between saves, or 'auto' (seconds from a save's measured cost, Young's rule:
    # recovery/cadence.py); the last step is always saved too
    checkpoint_every: int | str = DEFAULT_CHECKPOINT_EVERY
    # node-local directory (e.g. /dev/shm) for the survivors' copies: written at memory
    # speed, restored in place by a relaunch onto the same plan (recovery/local_copies.py)
    local_copy_dir: str | None = None
    # continue from the newest good state in checkpoint_dir (refused when another run wrote
    # it, see recovery/run_identity.py); RESUME_FORCE: continue even then
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
    # detector + scheduler: re-plan around slow devices in place (False: the same loop,
    # nothing watched; a failed step is still survived)
    adapt: bool = False
    precompile: int = 0  # with adapt: likely next plans compiled in the background
    background_compile: bool = True  # with adapt: train a split while a new mesh compiles
    hang_floor_s: float = 10.0  # a step deadline is never below this
    step_timeout_s: float = 120.0  # the deadline before the cost model predicts one
    compile_cache_dir: str | None = None  # JAX's persistent compilation cache (None: off)
    devices: int | None = None  # one process: devices to use (default: the plan's count)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"RunConfig.steps={self.steps!r}: must be >= 1")
        check_interval(self.checkpoint_every, "RunConfig.checkpoint_every")
        if self.survivor_copies not in SURVIVOR_COPY_MODES:
            raise ConfigError(f"RunConfig.survivor_copies={self.survivor_copies!r}: valid are "
                              f"{', '.join(SURVIVOR_COPY_MODES)}")
        if self.local_copy_dir is not None and (self.checkpoint_dir is None
                                                or self.survivor_copies == "off"):
            raise ConfigError(f"RunConfig.local_copy_dir={self.local_copy_dir!r} needs a "
                              "checkpoint_dir and survivor_copies other than 'off'")
        if self.resume not in (False, True, RESUME_FORCE):
            raise ConfigError(f"RunConfig.resume={self.resume!r}: valid are False, True and "
                              f"{RESUME_FORCE!r} (continue even from another run's state)")
        if self.resume and self.checkpoint_dir is None:
            raise ConfigError("RunConfig.resume needs a checkpoint_dir")
        if self.precompile < 0:
            raise ConfigError(f"RunConfig.precompile={self.precompile}: must be >= 0")
        if (self.precompile or not self.background_compile) and not self.adapt:
            raise ConfigError("RunConfig.precompile and background_compile=False need adapt=True "
                              "(only an adapting run switches plans)")
        self.ladder()  # checks the two times
        check_metrics(self.metrics, self.profile_steps, "RunConfig.")
        if self.devices is not None and self.devices < 1:
            raise ConfigError(f"RunConfig.devices={self.devices}: must be >= 1 or None")

    def ladder(self) -> Ladder:
        """The run's time limits: step deadline < heartbeat < initialization."""
        return Ladder(floor_s=self.hang_floor_s, startup_s=self.step_timeout_s)


def check_metrics(metrics: Any, profile_steps: Any, prefix: str = "") -> None:
    """ConfigError, naming `prefix`metrics or `prefix`profile_steps, for a destination that
    is not one (or whose library is missing) or steps to profile with nowhere to write."""
    destinations = parse_destinations(metrics, f"{prefix}metrics")
    if check_steps(profile_steps, f"{prefix}profile_steps") is not None and \
            metrics_directory(destinations) is None:
        raise ConfigError(f"{prefix}profile_steps={profile_steps!r}: the trace is written into "
                          "the metrics directory: give metrics='tensorboard:DIR' too")
