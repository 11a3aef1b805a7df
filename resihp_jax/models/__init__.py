"""`rh.models`: ready-made plain Flax NNX models that `rh.fit` trains like a user's own:
`Llama` (from a `ModelConfig` or a preset's name, e.g. 'tiny') and `GPT2`, written as a user
writes one. `config` and `registry` import no JAX; the models load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from resihp_jax.models.config import ModelConfig, get_model_config

# a name -> its module, imported on first use (`resihp plan` reads presets without JAX)
_LAZY = {"GPT2": "gpt2", "GPT2Block": "gpt2", "Llama": "llama", "LlamaBlock": "llama"}

__all__ = ["GPT2", "GPT2Block", "Llama", "LlamaBlock", "ModelConfig",
           "get_model_config"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"resihp_jax.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'resihp_jax.models' has no attribute {name!r}")
