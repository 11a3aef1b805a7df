"""gpt2_speed: the GPT-2 example's own NNX model (rh.models.GPT2, examples/user_model/
train_gpt2.py) trained through `rh.fit`'s step (the one step builder; its `segment_attention`
"auto": cuDNN's packed layout on GPUs) against a plain `jax.jit` loop of the same model and
optimizer whose blocks call `jax.nn.dot_product_attention` (cuDNN where it compiles, else
XLA's), in the same process on the same batch: bf16 compute from float32 weights on both
sides, medians over interleaved rounds, tokens/s, ours/peer and MFU of each. GPT-2 small's
sizes on a GPU (d=768, 12 heads, 12 blocks, a 50,257-token vocabulary, 8 x 1024 rows); a tiny
one in --quick."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from benchmarks import mfu
from benchmarks.gpu_sections.common import Suite, print_table
from resihp_jax.data import BatchIterator, GlobalBatch
from resihp_jax.plan import Plan
from resihp_jax.models.registry import GPT2Sizes, factory
from resihp_jax.nn.layers import next_token_targets
from resihp_jax.runtime.run.programs import model_programs
from resihp_jax.step.body import token_nll_sum
from resihp_jax.step.config import StepConfig

LEARNING_RATE = 3e-4


def sizes(quick: bool) -> tuple[GPT2Sizes, int, int]:
    """(the model, rows, tokens per row)."""
    if quick:
        return GPT2Sizes("gpt2-quick", d_model=32, n_heads=4, n_layers=2), 2, 64
    return GPT2Sizes("gpt2-small", d_model=768, n_heads=12, n_layers=12, vocab_size=50_257,
                     dtype="bfloat16"), 8, 1024


def our_runner(entry: GPT2Sizes, plan: Plan, device: jax.Device, batch: GlobalBatch,
               seed: int) -> mfu.Runner:
    """rh.fit's step of the model: its programs, on plan 1/1/1 of `device`."""
    compute = None if entry.dtype == "float32" else entry.dtype
    programs = model_programs(factory(entry, plan.seq_len), optax.adamw(LEARNING_RATE), seed,
                              axis_rules=entry.axis_rules, compute_dtype=compute)
    program = programs(StepConfig(microbatch_slots=1), plan, [device])
    sharded = program.shard_batch(batch.tokens_MxBxS, batch.segment_ids_MxBxS,
                                  batch.positions_MxBxS)
    return mfu.Runner(lambda s: program.step(s, sharded), program.init_state(seed),
                      lambda s: program.step_fn.lower(s, sharded, program.splits()))


def peer_block(block: Any, h_BxSxD: jax.Array, seg_BxS: jax.Array,
               implementation: str) -> jax.Array:
    """GPT2Block's math, its attention by jax.nn.dot_product_attention under a
    same-document mask (what a user writes without our library)."""
    b, s, d = h_BxSxD.shape
    qkv = block.qkv(block.ln1(h_BxSxD)).reshape(b, s, 3, block.heads, d // block.heads)
    same_Bx1xSxS = ((seg_BxS[:, :, None] == seg_BxS[:, None, :])
                    & (seg_BxS[:, :, None] > 0))[:, None]
    att = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2],
                                       mask=same_Bx1xSxS, is_causal=True,
                                       implementation=implementation)
    h_BxSxD = h_BxSxD + block.proj(att.reshape(b, s, d))
    return h_BxSxD + block.down(jax.nn.gelu(block.up(block.ln2(h_BxSxD))))


def peer_loss_sum(params: Any, tokens_BxS: jax.Array, seg_BxS: jax.Array, pos_BxS: jax.Array,
                  *, graph: Any, dtype: Any, implementation: str):
    model = nnx.merge(graph, jax.tree.map(lambda w: w.astype(dtype), params))
    h_BxSxD = model.embed(tokens_BxS, pos_BxS)
    for block in model.blocks:
        h_BxSxD = peer_block(block, h_BxSxD, seg_BxS, implementation)
    targets, weights = next_token_targets(tokens_BxS, seg_BxS)
    return token_nll_sum(model.head(h_BxSxD).astype(jnp.float32), targets, weights), \
        jnp.sum(weights)


def peer_runner(entry: GPT2Sizes, seq_len: int, device: jax.Device, batch: GlobalBatch,
                seed: int, implementation: str) -> mfu.Runner:
    """The plain loop's step: value_and_grad of the model's loss sum, the mean's gradient,
    optax's update, one jit on `device`."""
    with nnx.use_eager_sharding(False):
        graph, params = nnx.split(factory(entry, seq_len)(nnx.Rngs(seed)), nnx.Param)
    params = jax.device_put(params, device)
    optimizer = optax.adamw(LEARNING_RATE)
    dtype = jnp.dtype(entry.dtype)
    loss = functools.partial(peer_loss_sum, graph=graph, dtype=dtype,
                             implementation=implementation)
    rows = [jnp.asarray(a.reshape(-1, seq_len)) for a in (
        batch.tokens_MxBxS, batch.segment_ids_MxBxS, batch.positions_MxBxS)]

    @jax.jit
    def step(state: tuple[Any, Any]) -> tuple[tuple[Any, Any], dict[str, jax.Array]]:
        params, opt_state = state
        (total, count), grads = jax.value_and_grad(loss, has_aux=True)(params, *rows)
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": total / count}

    state = (params, optimizer.init(params))
    return mfu.Runner(step, state, lambda s: step.lower(s))


def best_peer(entry: GPT2Sizes, seq_len: int, device: jax.Device, batch: GlobalBatch,
              seed: int) -> tuple[str, mfu.Runner]:
    """cuDNN where its first step compiles and runs (GPUs, bf16), else XLA's attention."""
    for implementation in ("cudnn", "xla"):
        if implementation == "cudnn" and device.platform != "gpu":
            continue
        try:
            runner = peer_runner(entry, seq_len, device, batch, seed, implementation)
            jax.block_until_ready(runner.step(runner.state))  # compiles: refusals show here
            return implementation, runner
        except Exception as error:  # noqa: BLE001 - any refusal means: try the next one
            print(f"gpt2 peer: {implementation} attention unavailable "
                  f"({type(error).__name__}: {str(error).splitlines()[0][:160]})")
    raise RuntimeError("no attention implementation compiled for the GPT-2 peer")


def model_flops(entry: GPT2Sizes, seg_NxS: np.ndarray) -> tuple[float, int]:
    """(FLOPs of one training step, non-padding tokens): 6 x the matmul parameters (the
    tied table counts once, as the head's matmul; the position table is a lookup) per token,
    and causal attention within each document."""
    d, layers, vocab = entry.d_model, entry.n_layers, entry.vocab_size
    per_block = 12 * d * d  # qkv 3d^2, projection d^2, MLP 8d^2 (biases and norms left out)
    tokens = int(np.sum(np.asarray(seg_NxS) > 0))
    lengths = mfu.document_lengths(seg_NxS)
    pairs = float(np.sum(lengths * (lengths + 1) / 2))
    return 6.0 * (layers * per_block + vocab * d) * tokens + 12.0 * layers * d * pairs, tokens


def run(suite: Suite) -> dict[str, Any]:
    entry, rows, seq_len = sizes(suite.quick)
    device = suite.device
    batch = BatchIterator("synthetic:lognormal", n_microbatches=1, microbatch_size=rows,
                          seq_len=seq_len, seed=suite.seed).next_batch()
    if batch.tokens_MxBxS.max() >= entry.vocab_size:
        raise ValueError(f"token ids reach {batch.tokens_MxBxS.max()}; the vocabulary has "
                         f"{entry.vocab_size}")
    plan = Plan.uniform(1, 1, 1, n_layers=entry.n_layers, n_microbatches=1,
                        microbatch_size=rows, seq_len=seq_len, device_ids=(int(device.id),))
    print(f"\ngpt2_speed: {entry.describe()} at {rows} x {seq_len}")
    kind, peer = best_peer(entry, seq_len, device, batch, suite.seed)
    runners = {"ours": our_runner(entry, plan, device, batch, suite.seed), "peer": peer}
    samples, first = mfu.measure(runners, warmup=2, rounds=suite.rounds)
    seg_NxS = batch.segment_ids_MxBxS.reshape(-1, seq_len)
    flops, tokens = model_flops(entry, seg_NxS)
    labels = {"ours": "segment_attention[auto]", "peer": f"dot_product_attention[{kind}]"}
    result = mfu.report(samples, first, flops, tokens, 1, mfu.peak_flops(device, None), device,
                        labels)
    result["model"] = entry.name
    print_table("gpt2_speed: rh.fit's step / plain jit loop, medians over "
                f"{suite.rounds} interleaved rounds",
                [{"model": entry.name, "ours tok/s": result.get("tokens_per_s_per_device"),
                  "peer tok/s": result.get("peer_tokens_per_s_per_device"),
                  "ours/peer": result.get("ratio"), "MFU": result.get("mfu"),
                  "peer MFU": result.get("peer_mfu")}],
                ["model", "ours tok/s", "peer tok/s", "ours/peer", "MFU", "peer MFU"])
    return result
