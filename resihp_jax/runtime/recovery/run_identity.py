"""A run's identity: what must match for a checkpoint to be resumed by this run.

The model, the optimizer, the data source and seed, and the global batch shape decide the
training math; a checkpoint written under other values would continue a different run, so it
is refused, naming what changed. The Plan (mesh, splits, placement) and compile settings
(remat, slot counts) are deliberately left out: every plan computes the same steps, and
restoring into another plan is what the checkpoints are for. A resume forced on purpose
(`resume="force"`, `--resume force`) continues anyway and says what differed.

A run of `build_step` (`resihp train`: `rh.models.Llama` from a ModelConfig) is identified by
its ModelConfig, StepConfig's optimizer fields and its state's layout (`STATE_LAYOUT`); a
user's model and optax optimizer describe themselves (runtime/run/model_identity.py).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from resihp_jax.errors import CheckpointError
from resihp_jax.models.config import ModelConfig

_OPTIMIZER_FIELDS = ("learning_rate", "warmup_steps", "weight_decay", "b1", "b2", "grad_clip")
_DATA_FIELDS = ("source", "fingerprint", "seed")
_BATCH_FIELDS = ("n_microbatches", "microbatch_size", "seq_len")
_MOST_NAMED = 4  # differences spelled out in one line; the rest are counted
# The state's parameters as the one step builder lays them out; a checkpoint from before it
# (the retired built-in decoder's {embed, layers, head}) has none: convert.py converts it.
STATE_LAYOUT = "rh.models.Llama {shell, blocks}"


def run_identity(model: ModelConfig, train_cfg: Any, data_state: Mapping[str, Any],
                 ) -> dict[str, Any]:
    """The identity of `rh.models.Llama(model)` trained with `train_cfg`'s optimizer, from
    its configs and a `BatchIterator.state()`."""
    return json_ready({
        "state_layout": STATE_LAYOUT,
        "model": dataclasses.asdict(model),
        "optimizer": {name: getattr(train_cfg, name) for name in _OPTIMIZER_FIELDS},
        **data_identity(data_state),
    })


def identity_of(programs: Any, model: Any, train_cfg: Any,
                data_state: Mapping[str, Any]) -> dict[str, Any]:
    """A run's identity: its step builder's own, where it has one (a model's programs describe
    the model and its optax optimizer: runtime/run/model_identity.py), else the ModelConfig
    `model`'s and `train_cfg`'s (`run_identity`)."""
    identity = getattr(programs, "identity", None)
    if identity is not None:
        return identity(data_state)
    return run_identity(model, train_cfg, data_state)


def data_identity(data_state: Mapping[str, Any]) -> dict[str, Any]:
    """The data and batch-shape parts of an identity, from a `BatchIterator.state()`."""
    return {"data": {name: data_state[name] for name in _DATA_FIELDS},
            "batch": {name: data_state[name] for name in _BATCH_FIELDS}}


def json_ready(identity: Mapping[str, Any]) -> dict[str, Any]:
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


def retired_layout(saved: Mapping[str, Any] | None) -> bool:
    """Whether `saved` is the identity of the retired built-in decoder's run (a ModelConfig
    identity without a layout; recovery/convert.py converts its checkpoints)."""
    return (saved is not None and "state_layout" not in saved
            and "d_model" in saved.get("model", {}))


def _summary(differences: list[str]) -> str:
    # a wider model changes every parameter's shape: name the first few, count the rest
    named = "; ".join(differences[:_MOST_NAMED])
    more = len(differences) - _MOST_NAMED
    return named + (f"; and {more} more" if more > 0 else "")


def check_identity(saved: Mapping[str, Any] | None, current: Mapping[str, Any],
                   where: str, force: bool = False) -> str | None:
    """CheckpointError naming what differs between the two runs; with `force`, the one line
    to tell the user instead (None: the same run)."""
    differences = identity_differences(saved, current)
    if not differences:
        return None
    if retired_layout(saved) and current.get("state_layout") == STATE_LAYOUT:
        raise CheckpointError(
            f"{where} holds the retired built-in decoder's state ({{embed, layers, head}}, "
            "written by resihp_jax before every model trained through one step): convert it "
            "first with `python tools/convert_decoder_checkpoint.py SOURCE_DIR NEW_DIR`, then "
            "resume from NEW_DIR")
    if force:
        return (f"resume forced: continuing from {where} though it was written by a different "
                f"run: {_summary(differences)}")
    raise CheckpointError(
        f"{where} was written by a different run: {_summary(differences)}. Resume with the "
        "same model, optimizer, data, seed and batch shape, use another checkpoint directory, "
        "or force the resume (rh.fit(resume='force'), resihp train --resume force)")
