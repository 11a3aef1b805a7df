"""`rh.models`: ready-made models behind the user's-model contract (step/model_parts.py), written
as plain Flax NNX models, so `rh.fit` trains them like a user's own: `rh.models.Llama`, built
from a `ModelConfig` or a preset's name (`rh.models.get_model_config('tiny')`, or just 'tiny'),
and `rh.models.GPT2`, a GPT-2 written as a user writes one (examples/user_model/train_gpt2.py,
`resihp demo --model gpt2`).

`config` (the sizes and presets) and `registry` (every model a command can name) import no
JAX: the planner and the simulator read them. The models themselves load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from resihp_jax.models.config import ModelConfig, get_model_config

# a name -> the module that defines it, imported when the name is first asked for, so
# `resihp plan` can read the presets without starting JAX
_LAZY = {"GPT2": "gpt2", "GPT2Block": "gpt2", "Llama": "llama", "LlamaBlock": "llama"}

__all__ = ["GPT2", "GPT2Block", "Llama", "LlamaBlock", "ModelConfig",
           "get_model_config"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"resihp_jax.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'resihp_jax.models' has no attribute {name!r}")
