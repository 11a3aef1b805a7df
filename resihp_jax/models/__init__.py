"""`rh.models`: ready-made models behind the user's-model contract (train/user_model.py), written
as plain Flax NNX models, so `rh.fit` trains them like a user's own: `rh.models.Llama`."""

from resihp_jax.models.llama import Llama, LlamaBlock, from_builtin, to_builtin

__all__ = ["Llama", "LlamaBlock", "from_builtin", "to_builtin"]
