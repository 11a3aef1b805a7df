"""Shared test fixtures: a packed batch with known documents and the single-device reference."""

from __future__ import annotations

import functools
from concurrent.futures import Executor, Future
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from resihp_jax.data import BatchIterator, GlobalBatch
from resihp_jax.meshes import layout
from resihp_jax.plan import Plan
from resihp_jax.nn import layers
from resihp_jax.models.config import ModelConfig
from resihp_jax.step.config import StepConfig
from resihp_jax.runtime.run.programs import preset_programs
from resihp_jax.step.instrument import Instrument
from resihp_jax.step.program import StepProgram
from tests.xla_flags import child_env


def run_processes(script: str, n: int, devices: int, *args: str,
                  timeout_s: float = 600) -> list[dict]:
    """`script` (python -c) as `n` local processes of `devices` CPU devices each, argv
    `PROCESS_ID PORT *args`; the JSON each prints after "RESULT ", in process order."""
    import json
    import subprocess
    import sys

    from resihp_jax.runtime.job.supervisor import free_port

    port = str(free_port())
    env = dict(child_env(devices), JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(i), port, *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(n)]
    outputs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    results = []
    for proc, text in zip(procs, outputs):
        assert proc.returncode == 0, text
        line = next(x for x in text.splitlines() if x.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
    return results


def llama_step(cfg: ModelConfig, train: StepConfig, plan: Plan,
               devices: Any = None, instrument: Instrument | None = None,
               **preset: Any) -> StepProgram:
    """The step of `rh.models.Llama(cfg)` for `plan` on `devices` (default: all), as every
    preset trains: its `preset_programs` (`preset`: their optimizer, attention), called."""
    devices = list(jax.devices() if devices is None else devices)
    _, programs = preset_programs(cfg, plan.seq_len, device=devices[0], **preset)
    return programs(train, plan, devices, instrument)


@functools.lru_cache(maxsize=16)
def step_program(cfg: ModelConfig, train: StepConfig, plan: Plan) -> StepProgram:
    """`llama_step` on all devices, built (and compiled) once per test session for each
    model, train config and plan: a program is immutable, every test starts its own state."""
    return llama_step(cfg, train, plan)


def make_batches(n_microbatches: int, microbatch_size: int = 2, seq_len: int = 64,
                 n_batches: int = 1, seed: int = 0) -> list[GlobalBatch]:
    it = BatchIterator("synthetic:lognormal", n_microbatches=n_microbatches,
                       microbatch_size=microbatch_size, seq_len=seq_len, seed=seed)
    return [it.next_batch() for _ in range(n_batches)]


def llama_params(cfg: ModelConfig, seed: int = 0) -> dict[str, Any]:
    """The canonical parameters `{"shell", "blocks"}` of `rh.models.Llama(cfg)` for `seed`:
    what `llama_step(cfg, ...).init_state(seed)` starts from, built whole on one device."""
    from flax import nnx

    from resihp_jax.models import Llama
    from resihp_jax.step.model_parts import split_model

    _, shell, blocks = split_model(Llama(cfg, rngs=nnx.Rngs(seed)))
    return {"shell": shell, "blocks": blocks}


def llama_loss_sum(cfg: ModelConfig) -> Any:
    """(params, tokens, seg, pos) -> (summed token losses, token count) of
    `rh.models.Llama(cfg)` on whole weights (canonical `{"shell", "blocks"}`), through the
    model's own `__call__`: no plan, no pipeline, no shard_map."""
    from flax import nnx

    from resihp_jax.models import Llama
    from resihp_jax.step.model_parts import split_model

    with nnx.use_eager_sharding(False):
        parts = split_model(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))[0]

    def loss_sum(p: Any, tokens: Any, seg: Any, pos: Any) -> tuple[jax.Array, jax.Array]:
        logits = parts.assemble(p["shell"], p["blocks"])(tokens, seg, pos)
        targets, weights = layers.next_token_targets(tokens, seg)
        return layers.token_loss_sum(logits, targets, weights), weights.sum()
    return loss_sum


def reference_loss_and_grads(cfg: ModelConfig, params: Any, batch: GlobalBatch):
    """Token-weighted mean loss over all micro-batches on whole weights `params` (canonical
    `{"shell", "blocks"}`) in a plain jit (`llama_loss_sum`), and its gradients."""
    loss_sum = llama_loss_sum(cfg)

    def mean_loss(p: Any) -> jax.Array:
        # a scan over the micro-batches, summed in order: one copy of the model to compile
        # (unrolled, the eight copies took 40 s of compile against a few)
        def add(carry: tuple[jax.Array, jax.Array], mb: tuple[jax.Array, ...]) -> Any:
            loss, n = loss_sum(p, *mb)
            return (carry[0] + loss, carry[1] + n), None

        zero = jnp.zeros((), jnp.float32)
        (total, count), _ = jax.lax.scan(add, (zero, zero), (
            batch.tokens_MxBxS, batch.segment_ids_MxBxS, batch.positions_MxBxS))
        return total / count
    return jax.jit(jax.value_and_grad(mean_loss))(params)


def canonical_grads(program: StepProgram, grads: Any) -> Any:
    return jax.device_get(layout.to_canonical_layout(grads, program.canonical_positions()))


def max_relative_error(tree: Any, reference: Any) -> float:
    errs = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))
                                           / (np.max(np.abs(np.asarray(b))) + 1e-12)),
                        tree, reference)
    return max(jax.tree.leaves(errs))


class AtOnce(Executor):
    """Runs what is submitted in the caller's thread: a Checkpointer's handed-off saves on a
    test's fake clock, which a thread of their own would read at a moment of its choosing."""

    def submit(self, fn, /, *args: Any, **kwargs: Any) -> Future:  # noqa: ANN001
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001 - the future holds it, as a thread's would
            future.set_exception(err)
        return future
