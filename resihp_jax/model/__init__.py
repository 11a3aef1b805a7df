"""The decoder: config presets (importable without JAX), NNX modules in `decoder`, and the
pure math the train step shards in `layers`."""

from resihp_jax.model.config import PRESETS, ModelConfig, get_model_config

__all__ = ["PRESETS", "ModelConfig", "get_model_config"]
