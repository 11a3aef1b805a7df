"""resihp_jax: hybrid-parallel (data x pipeline x tensor) LLM training in JAX that stays fast
when devices slow down or stop: it detects the slow or dead device, re-plans the layer and
micro-batch split or the mesh, and moves the training state onto the new plan. Use it as
`import resihp_jax as rh`; only the names in `rh.__all__` are public, everything else
(every submodule) is internal and may change. Importing it starts no JAX backend.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# a process that `resihp launch`, srun or a JobSet started joins its job here, before the
# script builds its model (which starts JAX); elsewhere (a plain process, the CLI) nothing
from resihp_jax.runtime.job.autojoin import join_if_launched as _join_if_launched

_join_if_launched()

# public name -> the module defining it; imported on first use (PEP 562), so that importing
# the package (as the `resihp` CLI does) stays cheap and initializes no JAX backend
_EXPORTS: dict[str, str] = {
    # the model, the plan, the data
    "ModelConfig": "resihp_jax.model.config",
    "get_model_config": "resihp_jax.model.config",
    "Plan": "resihp_jax.meshes.plan",
    "BatchIterator": "resihp_jax.data.iterator",
    # devices
    "use_cpu_devices": "resihp_jax.runtime.job.devices",
    "devices": "resihp_jax.runtime.job.devices",
    # the step
    "TrainConfig": "resihp_jax.train.config",
    "build_step": "resihp_jax.train.step",
    "move_state": "resihp_jax.train.reshard",
    # resilient training
    "ResilienceConfig": "resihp_jax.runtime.trainer.resilient",
    "ResilientTrainer": "resihp_jax.runtime.trainer.resilient",
    "Replan": "resihp_jax.runtime.trainer.resilient",
    "StepRecord": "resihp_jax.runtime.trainer.loop",
    "Checkpointer": "resihp_jax.runtime.recovery.checkpoint",
    # the run `resihp train` performs (one process, a job's process, --adapt), from configs
    "RunConfig": "resihp_jax.runtime.run.config",
    "TrainingRun": "resihp_jax.runtime.run.training",
    "JobSpec": "resihp_jax.runtime.job.distributed",
    "job_spec": "resihp_jax.runtime.job.distributed",
    "join_job": "resihp_jax.runtime.job.join",
    # the user's own NNX model and data
    "fit": "resihp_jax.runtime.run.fit",
    "FitResult": "resihp_jax.runtime.run.fit",
    "PackedBatch": "resihp_jax.data.user_batches",
    # detection and re-planning on their own
    "Health": "resihp_jax.perfmodel.health",
    "make_detector": "resihp_jax.detector.base",
    "run_policy": "resihp_jax.scheduler.policies",
    # errors
    "ResihpError": "resihp_jax.errors",
    "ConfigError": "resihp_jax.errors",
    "PlanError": "resihp_jax.errors",
    "CheckpointError": "resihp_jax.errors",
    "TrainingDiverged": "resihp_jax.errors",
}

# spelt out, not computed from _EXPORTS, so that linters and type checkers read it
__all__ = [
    "BatchIterator",
    "CheckpointError",
    "Checkpointer",
    "ConfigError",
    "FitResult",
    "Health",
    "JobSpec",
    "ModelConfig",
    "PackedBatch",
    "Plan",
    "PlanError",
    "Replan",
    "ResihpError",
    "ResilienceConfig",
    "ResilientTrainer",
    "RunConfig",
    "StepRecord",
    "TrainConfig",
    "TrainingDiverged",
    "TrainingRun",
    "build_step",
    "devices",
    "fit",
    "get_model_config",
    "job_spec",
    "join_job",
    "make_detector",
    "move_state",
    "run_policy",
    "use_cpu_devices",
]

if TYPE_CHECKING:
    from resihp_jax.data.iterator import BatchIterator
    from resihp_jax.data.user_batches import PackedBatch
    from resihp_jax.detector.base import make_detector
    from resihp_jax.errors import (
        CheckpointError,
        ConfigError,
        PlanError,
        ResihpError,
        TrainingDiverged,
    )
    from resihp_jax.meshes.plan import Plan
    from resihp_jax.model.config import ModelConfig, get_model_config
    from resihp_jax.perfmodel.health import Health
    from resihp_jax.runtime.job.devices import devices, use_cpu_devices
    from resihp_jax.runtime.job.distributed import JobSpec, job_spec
    from resihp_jax.runtime.job.join import join_job
    from resihp_jax.runtime.recovery.checkpoint import Checkpointer
    from resihp_jax.runtime.run.config import RunConfig
    from resihp_jax.runtime.run.fit import FitResult, fit
    from resihp_jax.runtime.run.training import TrainingRun
    from resihp_jax.runtime.trainer.loop import StepRecord
    from resihp_jax.runtime.trainer.resilient import Replan, ResilienceConfig, ResilientTrainer
    from resihp_jax.scheduler.policies import run_policy
    from resihp_jax.train.config import TrainConfig
    from resihp_jax.train.reshard import move_state
    from resihp_jax.train.step import build_step


# submodules a user reaches as attributes: rh.data.from_documents(...), rh.nn.segment_attention,
# rh.models.Llama (ready-made models behind the same contract as a user's own)
_SUBMODULES = {"data": "resihp_jax.data", "nn": "resihp_jax.nn", "models": "resihp_jax.models"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'resihp_jax' has no attribute {name!r}; "
                             "the public names are in resihp_jax.__all__")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))
