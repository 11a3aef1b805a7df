"""user_path: `rh.fit` on plan 1/1/1 trains the example's own NNX GPT-2
(examples/user_model/train_gpt2.py) to what a plain `jax.jit` loop of the same model and
optimizer gives (losses under Adam, parameters under SGD: max abs differences), and
`rh.models.Llama` trains in bf16 (`compute_dtype="bfloat16"`): its loss falls over N steps."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import resihp_jax as rh
from benchmarks.gpu_sections.common import Suite, print_table
from benchmarks.resilience_price import batches
from examples.user_model.train_gpt2 import GPT2
from resihp_jax.models.config import get_model_config
from resihp_jax.nn.layers import next_token_targets
from resihp_jax.step.body import token_nll_sum

# precompile off: the likely next plans compiled in the background change no value here
QUIET = rh.ResilienceConfig(precompile=0, compile_cache_dir=None)


def sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"rows": 2, "seq": 64, "d": 32, "layers": 2, "steps": 3, "llama_steps": 6}
    return {"rows": 8, "seq": 256, "d": 128, "layers": 4, "steps": 10, "llama_steps": 30}


def gpt2(size: dict[str, int], seed: int) -> GPT2:
    with nnx.use_eager_sharding(False):
        return GPT2(d=size["d"], heads=4, layers=size["layers"], max_len=size["seq"],
                    rngs=nnx.Rngs(seed))


def mean_loss(model: GPT2, tokens, seg, pos) -> jax.Array:
    h = model.embed(tokens, pos)
    for block in model.blocks:
        h = block(h, seg, pos)
    targets, weights = next_token_targets(tokens, seg)
    return token_nll_sum(model.head(h), targets, weights) / jnp.maximum(weights.sum(), 1)


def plain_loop(model: GPT2, optimizer: optax.GradientTransformation,
               data: list[rh.PackedBatch]) -> list[float]:
    """The user's own loop: one jitted step of the same model on one device."""
    opt = nnx.Optimizer(model, optimizer, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, tokens, seg, pos):
        loss, grads = nnx.value_and_grad(mean_loss)(model, tokens, seg, pos)
        opt.update(model, grads)
        return loss

    return [float(step(model, opt, *map(jnp.asarray, b))) for b in data]


def params(model: nnx.Module) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model,
                                                                            nnx.Param)))]


def equivalence(suite: Suite, size: dict[str, int], name: str,
                optimizer: optax.GradientTransformation) -> dict[str, Any]:
    data = batches(size["rows"], size["seq"], size["steps"], suite.seed)
    plan = rh.Plan.uniform(1, 1, 1, n_layers=size["layers"], n_microbatches=1,
                           microbatch_size=size["rows"], seq_len=size["seq"])
    fitted = rh.fit(gpt2(size, suite.seed), data, optimizer=optimizer, plan=plan,
                    steps=size["steps"], devices=[suite.device], progress=False,
                    resilience=QUIET)
    mine = gpt2(size, suite.seed)
    losses = plain_loop(mine, optimizer, data)
    got = np.asarray(list(fitted.losses.values()))
    return {"optimizer": name, "steps": size["steps"],
            "loss_max_abs_diff": float(np.max(np.abs(got - np.asarray(losses)))),
            "param_max_abs_diff": float(max(np.max(np.abs(a - b)) for a, b in
                                            zip(params(fitted.model), params(mine)))),
            "final_loss": float(got[-1])}


def llama_bf16(suite: Suite, size: dict[str, int]) -> dict[str, Any]:
    cfg = get_model_config("tiny" if suite.quick else "small")
    data = batches(size["rows"], size["seq"], 2, suite.seed)
    n = size["llama_steps"]
    plan = rh.Plan.uniform(1, 1, 1, n_layers=cfg.n_layers, n_microbatches=1,
                           microbatch_size=size["rows"], seq_len=size["seq"])
    result = rh.fit(lambda rngs: rh.models.Llama(cfg, rngs=rngs), (data * n)[:n],
                    optimizer=optax.adam(3e-3), plan=plan, steps=n, devices=[suite.device],
                    progress=False, resilience=QUIET, compute_dtype="bfloat16")
    losses = list(result.losses.values())
    return {"model": cfg.name, "steps": n, "first_loss": losses[0], "last_loss": losses[-1],
            "falls": bool(np.mean(losses[-2:]) < np.mean(losses[:2])),
            "compute_dtype": result.facts.dtype}


def run(suite: Suite) -> dict[str, Any]:
    size = sizes(suite.quick)
    rows = [equivalence(suite, size, "sgd(0.1)", optax.sgd(0.1))]
    if not suite.quick:  # the same code with another optimizer: two more compiles on CPU
        rows.insert(0, equivalence(suite, size, "adam(1e-3)", optax.adam(1e-3)))
    print_table(f"user_path: rh.fit (plan 1/1/1) vs a plain jax.jit loop, the example's GPT-2 "
                f"(d={size['d']}, {size['layers']} layers), {size['rows']} x {size['seq']} rows",
                rows, list(rows[0]))
    bf16 = llama_bf16(suite, size)
    print_table("user_path: rh.models.Llama with compute_dtype='bfloat16' (2 batches in turn)",
                [bf16], list(bf16))
    return {"equivalence": rows, "llama_bf16": bf16}
