"""resihp_jax: hybrid-parallel (data x pipeline x tensor) LLM training in JAX that stays fast
when devices slow down or stop: it detects the slow or dead device, re-plans the layer and
micro-batch split or the mesh, and moves the training state onto the new plan. Use it as
`import resihp_jax as rh` and train your own Flax NNX model with `rh.fit`; only the names in
`rh.__all__` are public (the namespaces `rh.data`, `rh.nn`, `rh.models` and, for writing
one's own loop, `rh.engine`, each with its own `__all__`); every other submodule is internal
and may change. Importing it starts no JAX backend.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

# a process that `resihp launch`, srun or a JobSet started joins its job here, before the
# script builds its model (which starts JAX); elsewhere (a plain process, the CLI) nothing
from resihp_jax.runtime.job.autojoin import join_if_launched as _join_if_launched

_join_if_launched()

# public name -> the module defining it; imported on first use (PEP 562), so that importing
# the package (as the `resihp` CLI does) stays cheap and initializes no JAX backend
_EXPORTS: dict[str, str] = {
    # training your own model
    "fit": "resihp_jax.runtime.run.fit",
    "FitResult": "resihp_jax.runtime.run.fit",
    "StepRecord": "resihp_jax.runtime.events",
    "Replan": "resihp_jax.runtime.events",
    "Plan": "resihp_jax.plan",
    "PackedBatch": "resihp_jax.data.prepacked",
    "ResilienceConfig": "resihp_jax.runtime.config",
    # devices and the job
    "use_cpu_devices": "resihp_jax.runtime.job.devices",
    "devices": "resihp_jax.runtime.job.devices",
    "join_job": "resihp_jax.runtime.job.join",
    # errors
    "ResihpError": "resihp_jax.errors",
    "ConfigError": "resihp_jax.errors",
    "PlanError": "resihp_jax.errors",
    "CheckpointError": "resihp_jax.errors",
    "TrainingDiverged": "resihp_jax.errors",
}

# namespaces a user reaches as attributes (rh.data.from_documents, rh.engine.TrainingRun, ...)
_SUBMODULES = {"data": "resihp_jax.data", "nn": "resihp_jax.nn", "models": "resihp_jax.models",
               "engine": "resihp_jax.engine"}

# names that left the top level for rh.engine: resolvable for one release, with a warning
_MOVED_TO_ENGINE = frozenset({
    "BatchIterator", "Checkpointer", "Health", "JobSpec", "ModelConfig", "ResilientTrainer",
    "RunConfig", "StepConfig", "TrainingRun", "get_model_config", "job_spec",
    "make_detector", "move_state", "run_policy",
})

# spelt out, not computed from _EXPORTS, so that linters and type checkers read it
__all__ = [
    "CheckpointError",
    "ConfigError",
    "FitResult",
    "PackedBatch",
    "Plan",
    "PlanError",
    "Replan",
    "ResihpError",
    "ResilienceConfig",
    "StepRecord",
    "TrainingDiverged",
    "data",
    "devices",
    "engine",
    "fit",
    "join_job",
    "models",
    "nn",
    "use_cpu_devices",
]

if TYPE_CHECKING:
    from resihp_jax import data, engine, models, nn
    from resihp_jax.data.prepacked import PackedBatch
    from resihp_jax.errors import (
        CheckpointError,
        ConfigError,
        PlanError,
        ResihpError,
        TrainingDiverged,
    )
    from resihp_jax.plan import Plan
    from resihp_jax.runtime.job.devices import devices, use_cpu_devices
    from resihp_jax.runtime.job.join import join_job
    from resihp_jax.runtime.run.fit import FitResult, fit
    from resihp_jax.runtime.events import Replan, StepRecord
    from resihp_jax.runtime.config import ResilienceConfig


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    if name in _MOVED_TO_ENGINE:
        # not cached in globals(): every use warns, and dir(rh) never lists it
        warnings.warn(f"rh.{name} has moved to rh.engine.{name} (resihp_jax.engine); the "
                      "top-level name will be removed in the next release",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module("resihp_jax.engine"), name)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'resihp_jax' has no attribute {name!r}; "
                             "the public names are in resihp_jax.__all__")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
