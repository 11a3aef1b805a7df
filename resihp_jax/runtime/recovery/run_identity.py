"""A run's identity: what must match for a checkpoint to be resumed by this run.

The model, the optimizer, the data source and seed, and the global batch shape decide the
training math, so a checkpoint written under other values is refused, naming what changed.
The Plan and compile settings are deliberately left out: every plan computes the same
steps, and restoring into another plan is what the checkpoints are for. A resume forced on
purpose (`resume="force"`, `--resume force`) continues anyway and says what differed. A
checkpoint of the retired built-in decoder is refused, naming its converter (docs/DESIGN.md).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from resihp_jax.errors import CheckpointError

_DATA_FIELDS = ("source", "fingerprint", "seed")
_BATCH_FIELDS = ("n_microbatches", "microbatch_size", "seq_len")
_MOST_NAMED = 4  # differences spelled out in one line; the rest are counted


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
    """Whether `saved` is the identity of the retired built-in decoder's run (its ModelConfig,
    without a state layout; runtime/run/convert.py converts its checkpoints)."""
    return (saved is not None and "state_layout" not in saved
            and "d_model" in saved.get("model", {}))


def check_identity(saved: Mapping[str, Any] | None, current: Mapping[str, Any],
                   where: str, force: bool = False) -> str | None:
    """CheckpointError naming what differs between the two runs; with `force`, the one line
    to tell the user instead (None: the same run)."""
    differences = identity_differences(saved, current)
    if not differences:
        return None
    if retired_layout(saved):  # no run restores its tree: even a forced resume is refused
        raise CheckpointError(
            f"{where} holds the retired built-in decoder's state ({{embed, layers, head}}, "
            "written by resihp_jax before every model trained through one step): convert it "
            "first with `python tools/convert_decoder_checkpoint.py SOURCE_DIR NEW_DIR`, then "
            "resume from NEW_DIR")
    # a wider model changes every parameter's shape: name the first few, count the rest
    more = len(differences) - _MOST_NAMED
    summary = "; ".join(differences[:_MOST_NAMED]) + (f"; and {more} more" if more > 0 else "")
    if force:
        return (f"resume forced: continuing from {where} though it was written by a different "
                f"run: {summary}")
    raise CheckpointError(
        f"{where} was written by a different run: {summary}. Resume with the "
        "same model, optimizer, data, seed and batch shape, use another checkpoint directory, "
        "or force the resume (rh.fit(resume='force'), resihp train --resume force)")
