"""AdamWConfig, the presets' optimizer: validated in one line naming the field, the same AdamW
updates as with its schedule not injected, and the rate each update applied read off its
state (inside the chain) as the metrics read it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from resihp_jax.errors import ConfigError
from resihp_jax.models.optimizer import AdamWConfig
from resihp_jax.runtime.run.run_metrics import optimizer_learning_rate
from resihp_jax.step.program import TrainState


@pytest.mark.parametrize("changes, message", [
    ({"learning_rate": 0.0}, "AdamWConfig.learning_rate=0.0: must be a finite number > 0"),
    ({"grad_clip": float("inf")}, "AdamWConfig.grad_clip=inf: must be a finite number > 0"),
    ({"weight_decay": 1.0}, r"AdamWConfig.weight_decay=1.0: valid is \[0, 1\)"),
    ({"b2": -0.1}, r"AdamWConfig.b2=-0.1: valid is \[0, 1\)"),
    ({"warmup_steps": -1}, "AdamWConfig.warmup_steps=-1: must be >= 0"),
])
def test_a_bad_value_is_one_line_naming_the_field(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AdamWConfig(**changes)


def _trained(optimizer: optax.GradientTransformation, steps: int) -> tuple[list, list]:
    """Each step's parameters and state, from fixed parameters and gradients."""
    params = {"w": jnp.linspace(-1.0, 1.0, 60).reshape(6, 10)}
    state, update = optimizer.init(params), jax.jit(optimizer.update)
    kept, states = [], []
    for k in range(steps):
        grads = jax.tree.map(lambda x, k=k: jnp.sin(x * (k + 1)) * 3.0, params)  # clipped
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        kept.append(np.asarray(params["w"]))
        states.append(state)
    return kept, states


def test_it_is_clipped_adamw_on_the_warm_up_and_says_each_steps_rate() -> None:
    adamw = AdamWConfig(learning_rate=0.01, warmup_steps=4)
    steps = 7
    scheduled = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
        optax.linear_schedule(0.0025, 0.01, 4), b1=0.9, b2=0.95, weight_decay=0.1))
    want, _ = _trained(scheduled, steps)
    got, states = _trained(adamw.optimizer(), steps)
    for a, b in zip(got, want):  # injected hyper-parameters are float32 arrays: last bits
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    rates = [optimizer_learning_rate(n + 1, TrainState(np.int32(n + 1), {}, state))
             for n, state in enumerate(states)]
    assert rates == pytest.approx([0.0025, 0.004375, 0.00625, 0.008125, 0.01, 0.01, 0.01])
