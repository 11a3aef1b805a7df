"""`rh.models`: ready-made models behind the user's-model contract (train/user_model.py), written
as plain Flax NNX models, so `rh.fit` trains them like a user's own: `rh.models.Llama`, built
from a `ModelConfig` or a preset's name (`rh.models.get_model_config('tiny')`, or just 'tiny')."""

from resihp_jax.model.config import ModelConfig, get_model_config
from resihp_jax.models.llama import Llama, LlamaBlock, from_builtin, to_builtin

__all__ = ["Llama", "LlamaBlock", "ModelConfig", "from_builtin", "get_model_config",
           "to_builtin"]
