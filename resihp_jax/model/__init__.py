"""The decoder's sizes: config presets (importable without JAX), and in `layers` the pure
math `rh.models.Llama` and the train step's loss share."""

from resihp_jax.model.config import PRESETS, ModelConfig, get_model_config

__all__ = ["PRESETS", "ModelConfig", "get_model_config"]
