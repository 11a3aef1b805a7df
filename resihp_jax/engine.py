"""`rh.engine`: the building blocks behind `rh.fit`, for writing one's own training loop
(grouped in `_EXPORTS` below). A script that trains its own model needs none of them: it
calls `rh.fit`. Like the package, this module imports nothing until a name is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module defining it; imported on first use (PEP 562)
_EXPORTS: dict[str, str] = {
    # a model's step programs: a preset of rh.models.Llama from its configs
    "ModelConfig": "resihp_jax.models.config",
    "get_model_config": "resihp_jax.models.config",
    "AdamWConfig": "resihp_jax.models.optimizer",
    "StepConfig": "resihp_jax.step.config",
    "BatchIterator": "resihp_jax.data.iterator",
    "ModelPrograms": "resihp_jax.runtime.run.programs",
    "preset_programs": "resihp_jax.runtime.run.programs",
    "move_state": "resihp_jax.step.reshard",
    # the resilient loop and its checkpoints
    "ResilientTrainer": "resihp_jax.runtime.trainer.resilient",
    "Checkpointer": "resihp_jax.runtime.recovery.checkpoint",
    # the run `resihp train` performs, from typed configs
    "RunConfig": "resihp_jax.runtime.config",
    "TrainingRun": "resihp_jax.runtime.run.training",
    "JobSpec": "resihp_jax.runtime.job.distributed",
    "job_spec": "resihp_jax.runtime.job.distributed",
    # detection and re-planning on their own
    "Health": "resihp_jax.perfmodel.health",
    "make_detector": "resihp_jax.detector.base",
    "run_policy": "resihp_jax.scheduler.policies",
}

# spelt out, not computed from _EXPORTS, so that linters and type checkers read it
__all__ = [
    "AdamWConfig",
    "BatchIterator",
    "Checkpointer",
    "Health",
    "JobSpec",
    "ModelConfig",
    "ModelPrograms",
    "ResilientTrainer",
    "RunConfig",
    "StepConfig",
    "TrainingRun",
    "get_model_config",
    "job_spec",
    "make_detector",
    "move_state",
    "preset_programs",
    "run_policy",
]

if TYPE_CHECKING:
    from resihp_jax.data.iterator import BatchIterator
    from resihp_jax.detector.base import make_detector
    from resihp_jax.models.config import ModelConfig, get_model_config
    from resihp_jax.models.optimizer import AdamWConfig
    from resihp_jax.perfmodel.health import Health
    from resihp_jax.runtime.job.distributed import JobSpec, job_spec
    from resihp_jax.runtime.recovery.checkpoint import Checkpointer
    from resihp_jax.runtime.config import RunConfig
    from resihp_jax.runtime.run.programs import ModelPrograms, preset_programs
    from resihp_jax.runtime.run.training import TrainingRun
    from resihp_jax.runtime.trainer.resilient import ResilientTrainer
    from resihp_jax.scheduler.policies import run_policy
    from resihp_jax.step.config import StepConfig
    from resihp_jax.step.reshard import move_state


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'resihp_jax.engine' has no attribute {name!r}; "
                             "its names are in resihp_jax.engine.__all__")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
