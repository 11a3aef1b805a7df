"""`rh.models`: ready-made models behind the user's-model contract (step/model_parts.py), written
as plain Flax NNX models, so `rh.fit` trains them like a user's own: `rh.models.Llama`, built
from a `ModelConfig` or a preset's name (`rh.models.get_model_config('tiny')`, or just 'tiny'),
and `rh.models.GPT2`, a GPT-2 written as a user writes one (examples/user_model/train_gpt2.py,
`resihp demo --model gpt2`)."""

from resihp_jax.model.config import ModelConfig, get_model_config
from resihp_jax.models.gpt2 import GPT2, GPT2Block
from resihp_jax.models.llama import Llama, LlamaBlock

__all__ = ["GPT2", "GPT2Block", "Llama", "LlamaBlock", "ModelConfig", "get_model_config"]
