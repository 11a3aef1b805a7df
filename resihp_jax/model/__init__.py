"""The decoder: config presets, NNX modules, and the pure math the train step shards."""

from resihp_jax.model.config import PRESETS, ModelConfig, get_model_config
from resihp_jax.model.decoder import LOGICAL_AXES, Decoder, init_params

__all__ = ["PRESETS", "LOGICAL_AXES", "Decoder", "ModelConfig", "get_model_config",
           "init_params"]
