"""A run's identity: what must match for a checkpoint to be resumed by this run.

The model, the optimizer's hyper-parameters, the data source and seed, and the global batch
shape decide the training math; a checkpoint written under other values would continue a
different run, so it is refused. The Plan (mesh, splits, placement) and compile settings
(remat, slot counts) are deliberately left out: every plan computes the same steps, and
restoring into another plan is what the checkpoints are for.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from resihp_jax.errors import CheckpointError
from resihp_jax.model.config import ModelConfig

_OPTIMIZER_FIELDS = ("learning_rate", "warmup_steps", "weight_decay", "b1", "b2", "grad_clip")
_DATA_FIELDS = ("source", "fingerprint", "seed")
_BATCH_FIELDS = ("n_microbatches", "microbatch_size", "seq_len")


def run_identity(model: ModelConfig, train_cfg: Any, data_state: Mapping[str, Any],
                 ) -> dict[str, Any]:
    """JSON-ready identity from the configs and a `BatchIterator.state()`."""
    identity = {
        "model": dataclasses.asdict(model),
        "optimizer": {name: getattr(train_cfg, name) for name in _OPTIMIZER_FIELDS},
        "data": {name: data_state[name] for name in _DATA_FIELDS},
        "batch": {name: data_state[name] for name in _BATCH_FIELDS},
    }
    return json.loads(json.dumps(identity))  # the form it has after a save and a load


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def identity_differences(saved: Mapping[str, Any] | None, current: Mapping[str, Any],
                         ) -> list[str]:
    """'name: saved X, this run Y' for every value that differs (empty: same run)."""
    if saved is None:
        return ["run identity: none saved (written by another program or an older version)"]
    old, new = _flatten(saved), _flatten(current)
    keys = [*new, *(key for key in old if key not in new)]  # model.name first
    return [f"{key}={old.get(key, '<absent>')!r} in the checkpoint, "
            f"{new.get(key, '<absent>')!r} in this run"
            for key in keys if old.get(key) != new.get(key)]


def check_identity(saved: Mapping[str, Any] | None, current: Mapping[str, Any],
                   where: str) -> None:
    """CheckpointError naming both values of every difference between the two runs."""
    differences = identity_differences(saved, current)
    if differences:
        raise CheckpointError(
            f"{where} was written by a different run: {'; '.join(differences)}. Resume with "
            "the same model, optimizer, data, seed and batch shape, or use another "
            "checkpoint directory")
