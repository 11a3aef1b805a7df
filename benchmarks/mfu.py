"""Model FLOPs utilization: our train step against a plain-JAX peer, in the same run.

Ours: `preset_programs` for the plan (default dp=pp=tp=1): `rh.models.Llama` through the one
step builder, `rh.fit`'s; its attention kernel the one `--attention` names (auto:
cuDNN's packed layout on GPUs, the block-sparse scan on CPU). The peer: the same model's
math on its own parameters, weights, batches and AdamW update as one `jax.jit` function
(no pipeline, no resilience, parameters replicated and rows split over the same devices),
its attention `jax.nn.dot_product_attention` with the segment mask and is_causal, in the best
implementation the device takes (cuDNN where it compiles, else XLA). Each round times one step
of each in turn after warm-up; medians over rounds.

Model FLOPs per step (PaLM / MaxText convention): 6 x (parameters in matmuls: every layer
weight and the output head; the input embedding is a lookup) x tokens, plus attention
12 x layers x d_model x (query-key pairs attended: l(l+1)/2 per packed document), where
tokens are the non-padding ones. MFU = model FLOPs / step time / (devices x peak); the peak
is the device's dense bf16 peak from PEAK_FLOPS, or --peak-tflops (unknown on CPU).
Usage: python benchmarks/mfu.py [--quick] [--model llama-1b] [--plan 1,1,1]
       [--seq-len 2048] [--microbatch-size 4] [--microbatches 1] [--attention auto]
       [--peak-tflops T] [--rounds 10] [--seed 0]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from resihp_jax.data import BatchIterator, GlobalBatch  # noqa: E402
from resihp_jax.plan import Plan  # noqa: E402
from resihp_jax.nn import layers  # noqa: E402
from resihp_jax.models import Llama  # noqa: E402
from resihp_jax.step.model_parts import split_model  # noqa: E402
from resihp_jax.attention.check import step_attention  # noqa: E402
from resihp_jax.models.config import ModelConfig, get_model_config  # noqa: E402
from resihp_jax.step.config import StepConfig  # noqa: E402
from resihp_jax.models.optimizer import AdamWConfig  # noqa: E402
from resihp_jax.runtime.run.programs import preset_programs  # noqa: E402

# Dense bf16 tensor peak per device, FLOP/s, by a substring of `device.device_kind` (first
# match wins, so the more specific names come first).
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12), ("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12),
    ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("TPU v6", 918e12),
    ("TPU v5 lite", 197e12), ("TPU v5", 459e12), ("TPU v4", 275e12),
)


class Runner(NamedTuple):
    step: Callable[[Any], tuple[Any, dict[str, jax.Array]]]
    state: Any
    # state -> the step lowered for it (jax.stages.Lowered): memory, HLO, no new compile
    lower: Callable[[Any], Any] | None = None


def peak_flops(device: jax.Device, override_tflops: float | None) -> float | None:
    if override_tflops is not None:
        return override_tflops * 1e12
    kind = getattr(device, "device_kind", "")
    return next((peak for name, peak in PEAK_FLOPS if name in kind), None)


def document_lengths(segment_ids_NxS: np.ndarray) -> np.ndarray:
    """Lengths of the runs of equal nonzero ids (the packed documents), over all rows."""
    lengths = []
    for row in np.asarray(segment_ids_NxS):
        cuts = np.flatnonzero(np.diff(row)) + 1
        for run in np.split(row, cuts):
            if run[0] > 0:
                lengths.append(len(run))
    return np.asarray(lengths, np.int64)


def model_flops(model: ModelConfig, segment_ids_NxS: np.ndarray) -> tuple[float, int]:
    """(model FLOPs of one training step, non-padding tokens) for these packed rows."""
    tokens = int(np.sum(np.asarray(segment_ids_NxS) > 0))
    matmul_params = model.param_count() - model.first_stage_param_count()
    lengths = document_lengths(segment_ids_NxS)
    pairs = float(np.sum(lengths * (lengths + 1) / 2))
    attention = 12.0 * model.n_layers * model.n_heads * model.head_dim * pairs
    return 6.0 * matmul_params * tokens + attention, tokens


# ----------------------------------------------------------------------------- the peer


def _segment_mask(seg_NxS: jax.Array) -> jax.Array:
    same = (seg_NxS[:, :, None] == seg_NxS[:, None, :]) & (seg_NxS[:, :, None] > 0)
    return same[:, None]  # [N, 1, S, S], broadcast over heads


def _peer_attention(p: dict[str, Any], x_NxSxD: jax.Array, seg_NxS: jax.Array,
                    pos_NxS: jax.Array, model: ModelConfig, implementation: str) -> jax.Array:
    h = layers.rms_norm(x_NxSxD, p["attn_norm"]["scale"], model.norm_eps)
    q = layers.rotary(jnp.einsum("bsd,dhk->bshk", h, p["wq"]), pos_NxS, model.rope_theta)
    k = layers.rotary(jnp.einsum("bsd,dgk->bsgk", h, p["wk"]), pos_NxS, model.rope_theta)
    v = jnp.einsum("bsd,dgk->bsgk", h, p["wv"])
    o = jax.nn.dot_product_attention(q, k, v, mask=_segment_mask(seg_NxS), is_causal=True,
                                     implementation=implementation)
    return jnp.einsum("bshk,hkd->bsd", o, p["wo"])


def _peer_mlp(p: dict[str, Any], x_NxSxD: jax.Array, model: ModelConfig) -> jax.Array:
    h = layers.rms_norm(x_NxSxD, p["mlp_norm"]["scale"], model.norm_eps)
    gate = jnp.einsum("bsd,df->bsf", h, p["w_gate"])
    return jnp.einsum("bsf,fd->bsd", jax.nn.silu(gate) * jnp.einsum("bsd,df->bsf", h, p["w_up"]),
                      p["w_down"])


def peer_loss_sum(params: dict[str, Any], tok_NxS: jax.Array, seg_NxS: jax.Array,
                  pos_NxS: jax.Array, model: ModelConfig, implementation: str):
    """rh.models.Llama's math on its own parameters (same layers, same casts), written as a
    plain JAX function with jax.nn.dot_product_attention and the layers under one scan."""
    shell = params["shell"]
    x = layers.embed(shell["table"], tok_NxS, dtype=model.dtype)
    blocks = jax.tree.map(lambda w: w.astype(model.dtype), params["blocks"])

    def one_layer(x: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, None]:
        x = x + _peer_attention(p, x, seg_NxS, pos_NxS, model, implementation)
        return x + _peer_mlp(p, x, model), None

    x, _ = jax.lax.scan(one_layer, x, blocks)
    targets, weights = layers.next_token_targets(tok_NxS, seg_NxS)
    logits = layers.logits(shell["final_norm"]["scale"].astype(model.dtype),
                           shell["lm_head"].astype(model.dtype), x, model.norm_eps)
    return layers.token_loss_sum(logits, targets, weights), jnp.sum(weights)


def llama_params(model: ModelConfig, seed: int) -> dict[str, Any]:
    """rh.models.Llama(model)'s canonical parameters for `seed` (call under jit)."""
    with nnx.use_eager_sharding(False):
        _, shell, blocks = split_model(Llama(model, rngs=nnx.Rngs(seed)))
    return {"shell": shell, "blocks": blocks}


def peer_runner(model: ModelConfig, devices: list[jax.Device], batch: GlobalBatch, seed: int,
                implementation: str) -> Runner:
    mesh = Mesh(np.asarray(devices), ("dp",))
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    optimizer = AdamWConfig().optimizer()  # ours's: the preset's own
    loss = functools.partial(peer_loss_sum, model=model, implementation=implementation)

    def train_step(state: tuple[Any, Any], tok, seg, pos):
        params, opt_state = state
        (total, count), grads = jax.value_and_grad(loss, has_aux=True)(params, tok, seg, pos)
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": total / count}

    step = jax.jit(train_step, in_shardings=(replicated, rows, rows, rows),
                   out_shardings=(replicated, replicated), donate_argnums=0)
    flat = [jax.device_put(a.reshape(-1, a.shape[-1]).astype(np.int32), rows)
            for a in (batch.tokens_MxBxS, batch.segment_ids_MxBxS, batch.positions_MxBxS)]

    def init() -> tuple[Any, Any]:
        params = llama_params(model, seed)
        return params, optimizer.init(params)

    state = jax.jit(init, out_shardings=replicated)()
    step.lower(state, *flat).compile()  # raises here if the implementation does not fit
    return Runner(lambda s: step(s, *flat), state, lambda s: step.lower(s, *flat))


def best_peer(model: ModelConfig, devices: list[jax.Device], batch: GlobalBatch,
              seed: int) -> tuple[str, Runner]:
    """cuDNN where it compiles for this model and device (GPUs, bf16/fp16), else XLA."""
    for implementation in ("cudnn", "xla"):
        if implementation == "cudnn" and devices[0].platform != "gpu":
            continue
        try:
            return implementation, peer_runner(model, devices, batch, seed, implementation)
        except Exception as error:  # noqa: BLE001 - any refusal means: try the next one
            print(f"peer: {implementation} attention unavailable ({type(error).__name__}: "
                  f"{str(error).splitlines()[0][:160]})")
    raise RuntimeError("no attention implementation compiled for the peer")


# ----------------------------------------------------------------------------- ours


def our_runner(model: ModelConfig, train: StepConfig, plan: Plan, devices: list[jax.Device],
               batch: GlobalBatch, seed: int, attention: str = "auto") -> tuple[Runner, str]:
    _, programs = preset_programs(model, plan.seq_len, attention=attention, device=devices[0])
    program = programs(train.replace(microbatch_slots=max(plan.microbatches_per_group)), plan,
                       devices)
    sharded = program.shard_batch(batch.tokens_MxBxS, batch.segment_ids_MxBxS,
                                  batch.positions_MxBxS)
    kind = step_attention(attention, model, plan.seq_len, devices[0])  # checked: cached
    return Runner(lambda s: program.step(s, sharded), program.init_state(seed),
                  lambda s: program.step_fn.lower(s, sharded, program.splits())), kind


def measure(runners: dict[str, Runner], warmup: int, rounds: int
            ) -> tuple[dict[str, list[float]], dict[str, float]]:
    states = {name: r.state for name, r in runners.items()}
    first: dict[str, float] = {}
    for _ in range(warmup):
        for name, runner in runners.items():
            states[name], metrics = runner.step(states[name])
            first.setdefault(name, float(metrics["loss"]))
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, runner in runners.items():
            start = time.perf_counter()
            states[name], metrics = runner.step(states[name])
            jax.block_until_ready((states[name], metrics))
            samples[name].append(time.perf_counter() - start)
    return samples, first


def report(samples: dict[str, list[float]], first: dict[str, float], flops: float,
           tokens: int, n_devices: int, peak: float | None, device: jax.Device,
           labels: dict[str, str]) -> dict[str, Any]:
    step_s = {name: float(np.median(s)) for name, s in samples.items()}
    per_device = {name: tokens / t / n_devices for name, t in step_s.items()}
    mfu = {name: (flops / t / (n_devices * peak) if peak else None)
           for name, t in step_s.items()}
    print(f"\n{'program':<8} {'attention':<28} {'step s':>9} {'tokens/s/dev':>13} "
          f"{'TFLOP/s/dev':>12} {'MFU':>7}")
    for name, t in step_s.items():
        shown = f"{mfu[name]:7.1%}" if mfu[name] is not None else f"{'n/a':>7}"
        print(f"{name:<8} {labels[name]:<28} {t:9.4f} {per_device[name]:13.0f} "
              f"{flops / t / n_devices / 1e12:12.4f} {shown}")
    ratio = per_device["ours"] / per_device["peer"]
    paired = float(np.median(np.asarray(samples["peer"]) / np.asarray(samples["ours"])))
    print(f"\nratio ours / peer, tokens/s: {ratio:.3f} of medians, {paired:.3f} median of "
          "per-round ratios (target >= 0.95 on a GPU)")
    print(f"first-step loss: ours {first['ours']:.5f}, peer {first['peer']:.5f}; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    shown_peak = f"{peak / 1e12:.4g} TFLOP/s per device" if peak else "unknown (--peak-tflops)"
    print(f"peak: {shown_peak} ({device.device_kind}); model FLOPs per step {flops:.4g}, "
          f"{tokens} tokens")
    return {"tokens_per_s_per_device": round(per_device["ours"], 1),
            "mfu": None if mfu["ours"] is None else round(mfu["ours"], 4),
            "peer_tokens_per_s_per_device": round(per_device["peer"], 1),
            "ratio": round(ratio, 4), "device": device.device_kind,
            "ratio_paired_rounds": round(paired, 4),
            "peer_mfu": None if mfu["peer"] is None else round(mfu["peer"], 4),
            "step_s": {n: round(t, 5) for n, t in step_s.items()},
            "attention": labels, "model_flops_per_step": flops, "tokens_per_step": tokens,
            "first_step_loss": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, CPU-sized (< 2 min)")
    parser.add_argument("--model", default=None, help="preset (default llama-1b; quick: tiny)")
    parser.add_argument("--plan", default="1,1,1", help="dp,pp,tp of our step (default 1,1,1)")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--microbatch-size", type=int, default=None)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--attention", default="auto", help="our preset's attention kernel")
    parser.add_argument("--dtype", default=None, help="compute dtype (default: the preset's)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak dense TFLOP/s per device (default: from the device table)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = get_model_config(args.model or ("tiny" if args.quick else "llama-1b"))
    if args.dtype:
        model = model.replace(dtype=args.dtype)
    seq_len = args.seq_len or (128 if args.quick else 2048)
    mb_size = args.microbatch_size or 4
    rounds = args.rounds or (20 if args.quick else 10)
    dp, pp, tp = (int(x) for x in args.plan.split(","))
    devices = jax.devices()[:dp * pp * tp]
    plan = Plan.uniform(dp, pp, tp, n_layers=model.n_layers, n_microbatches=args.microbatches,
                        microbatch_size=mb_size, seq_len=seq_len,
                        device_ids=tuple(int(d.id) for d in devices))
    train = StepConfig()
    batch = BatchIterator("synthetic:lognormal", n_microbatches=args.microbatches,
                          microbatch_size=mb_size, seq_len=seq_len, seed=args.seed).next_batch()
    flops, tokens = model_flops(model, batch.segment_ids_MxBxS.reshape(-1, seq_len))
    print(f"model={model.name} ({model.param_count() / 1e6:.1f}M params, {model.dtype}), "
          f"plan {dp}/{pp}/{tp}, {args.microbatches} x {mb_size} rows x {seq_len} tokens, "
          f"{len(document_lengths(batch.segment_ids_MxBxS.reshape(-1, seq_len)))} documents; "
          f"{devices[0].platform} ({devices[0].device_kind}), jax {jax.__version__}")
    ours, kind = our_runner(model, train, plan, devices, batch, args.seed, args.attention)
    peer_kind, peer = best_peer(model, devices, batch, args.seed)
    labels = {"ours": f"segment_attention[{kind}]",
              "peer": f"dot_product_attention[{peer_kind}]"}
    samples, first = measure({"ours": ours, "peer": peer}, warmup=2, rounds=rounds)
    peak = peak_flops(devices[0], args.peak_tflops)
    result = report(samples, first, flops, tokens, len(devices), peak, devices[0], labels)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
