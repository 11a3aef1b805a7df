"""Healthy step throughput: our dp=8 plan against a plain `jax.jit` data-parallel step.

The baseline is the obvious data-parallel step: `jax.jit` of value_and_grad of the
token-weighted mean loss of `rh.models.Llama` (its own `__call__` on all rows at once, whole
weights), the same optax
AdamW update and metrics, parameters replicated (`P()`), rows sharded over the 8 devices
(`P('dp')`), state donated. Same model, dtype, initial weights, global batches and devices.
Every round times each program once in turn (ours dp=8, plain, 2/2/2, 1/4/2),
so load that comes and goes hits all alike; medians over rounds. No faults are
injected: healthy devices.

Ours is the one step every model trains through (`preset_programs`: `rh.models.Llama` under
the plan, its tensor parallelism its own); each compiled step's per-device memory (XLA's
memory analysis: arguments + outputs - donated aliases + temporaries) is reported.

The metrics' cost: our dp=8 step as the training loop takes it (its loss fetched, its
StepRecord built) with and without process 0's metrics written to TensorBoard and a JSON
lines file (`rh.fit(metrics=...)`: each step's entry built and handed to the metrics thread),
timed side by side in every round: the ratio of the two is the writer's cost.
Usage: python benchmarks/healthy_throughput.py [--quick] [--model small|tiny] [--seed S]
       [--with-gspmd]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from resihp_jax import vma  # noqa: E402
from resihp_jax.data import BatchIterator, GlobalBatch  # noqa: E402
from resihp_jax.plan import Plan  # noqa: E402
from resihp_jax.metrics import Metrics  # noqa: E402
from resihp_jax.nn import layers  # noqa: E402
from resihp_jax.models.config import ModelConfig, get_model_config  # noqa: E402
from resihp_jax.models import Llama  # noqa: E402
from resihp_jax.perfmodel.costs import CostParams  # noqa: E402
from resihp_jax.perfmodel.memory import compiled_bytes  # noqa: E402
from resihp_jax.perfmodel.simulator import simulate_step  # noqa: E402
from resihp_jax.runtime.run.programs import preset_programs  # noqa: E402
from resihp_jax.runtime.run.run_metrics import RunMetrics, optimizer_learning_rate  # noqa: E402
from resihp_jax.runtime.events import StepRecord  # noqa: E402
from resihp_jax.step.config import StepConfig  # noqa: E402
from resihp_jax.step.program import StepProgram  # noqa: E402
from resihp_jax.models.optimizer import AdamWConfig  # noqa: E402
from resihp_jax.step.model_parts import split_model  # noqa: E402

SHAPES = ((8, 1, 1), (2, 2, 2), (1, 4, 2))  # (dp, pp, tp)
BASE = "8/1/1"  # one micro-batch per DP group: each device's rows in one tick, like plain jit
TICKS = "8/1/1 x2"  # the global micro-batch split: two ticks per group (micro-batching cost)
PLAIN = "plain_jit"
GSPMD = "plain_gspmd"
LOOP = "8/1/1 loop"  # the step as the loop takes it: loss fetched, record built
WATCHED = "8/1/1 +metrics"  # the same, its metrics written to TensorBoard and JSON lines


class PlainState(NamedTuple):
    step: jax.Array
    params: dict[str, Any]
    opt_state: Any


class Runner(NamedTuple):
    """One program under test: a state to thread through `step(state, batch_index)`."""
    step: Callable[[Any, int], tuple[Any, dict[str, jax.Array]]]
    state: Any


def name_of(dp: int, pp: int, tp: int) -> str:
    return f"{dp}/{pp}/{tp}"


def plain_runner(model: ModelConfig, devices: list[jax.Device],
                 batches: list[GlobalBatch], seed: int, gspmd: bool) -> Runner:
    """Plain DP: replicated params, rows sharded over 8 devices, same loss/optimizer/metrics.

    gspmd=False: jit around a shard_map over rows; each device takes value_and_grad of its
    rows' loss sum, then one psum of (loss sum, token count, grads) (the pmap-style recipe).
    gspmd=True: jit of value_and_grad on the whole batch, left to the partitioner; the
    attention kernel's scan over rows makes it all-gather rows, so it is kept as a reference.
    """
    mesh = Mesh(np.asarray(devices), ("dp",), axis_types=(AxisType.Auto,))
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    optimizer = AdamWConfig().optimizer()  # the preset's own, as ours trains with
    with nnx.use_eager_sharding(False):
        parts = split_model(nnx.eval_shape(lambda: Llama(model, rngs=nnx.Rngs(0))))[0]

    def init() -> PlainState:
        with nnx.use_eager_sharding(False):
            _, shell, blocks = split_model(Llama(model, rngs=nnx.Rngs(seed)))
        params = {"shell": shell, "blocks": blocks}
        return PlainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))

    def sum_count_grads(params: dict[str, Any], tok_NxS: jax.Array, seg_NxS: jax.Array,
                        pos_NxS: jax.Array):
        if not gspmd:  # local gradients: one explicit psum below, not one per use
            params = vma.vary(params, ("dp",))
        def loss(p: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
            logits = parts.assemble(p["shell"], p["blocks"])(tok_NxS, seg_NxS, pos_NxS)
            targets, weights = layers.next_token_targets(tok_NxS, seg_NxS)
            return layers.token_loss_sum(logits, targets, weights), jnp.sum(weights)

        (total, count), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return (total, count, grads) if gspmd else jax.lax.psum((total, count, grads), "dp")

    if not gspmd:
        sum_count_grads = jax.shard_map(sum_count_grads, mesh=mesh,
                                        in_specs=(P(), P("dp"), P("dp"), P("dp")),
                                        out_specs=P())

    def train_step(state: PlainState, tok_NxS: jax.Array, seg_NxS: jax.Array,
                   pos_NxS: jax.Array):
        total, count, grads = sum_count_grads(state.params, tok_NxS, seg_NxS, pos_NxS)
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": total / count, "tokens": count, "grad_norm": optax.global_norm(grads)}
        return PlainState(state.step + 1, params, opt_state), metrics

    step_fn = jax.jit(train_step, in_shardings=(replicated, rows, rows, rows),
                      out_shardings=(replicated, replicated), donate_argnums=0)
    flat = [tuple(jax.device_put(a.reshape(-1, a.shape[-1]).astype(np.int32), rows)
                  for a in (b.tokens_MxBxS, b.segment_ids_MxBxS, b.positions_MxBxS))
            for b in batches]
    state = jax.jit(init, out_shardings=replicated)()
    return Runner(lambda s, i: step_fn(s, *flat[i]), state)


def plan_runner(plan: Plan, model: ModelConfig, train: StepConfig,
                batches: list[GlobalBatch], seed: int) -> tuple[Runner, StepProgram, int]:
    """(runner, program, per-device bytes of its compiled step) of our step for `plan`."""
    _, programs = preset_programs(model, plan.seq_len)
    program = programs(train, plan, jax.devices())
    state = program.init_state(seed)

    def regroup(a_MxBxS: np.ndarray) -> np.ndarray:
        # The same rows in the same order, cut into this plan's micro-batch size.
        return a_MxBxS.reshape(-1, plan.microbatch_size, a_MxBxS.shape[-1])

    sharded = [program.shard_batch(*(regroup(a) for a in (
        b.tokens_MxBxS, b.segment_ids_MxBxS, b.positions_MxBxS))) for b in batches]
    memory = step_memory(program, state, sharded[0])
    return Runner(lambda s, i: program.step(s, sharded[i]), state), program, memory


def loop_runner(step: Callable[[Any, int], Any], state: Any, plan: Plan,
                batches: list[GlobalBatch], watch: Any = None) -> Runner:
    """`step` as the training loop runs it: the loss fetched and the StepRecord built after
    it, and with `watch` (a RunMetrics) the record's metrics handed to its writer."""
    done = [0]

    def run(state: Any, index: int) -> tuple[Any, dict]:
        start = time.perf_counter()
        state, metrics = step(state, index)
        host = jax.device_get(metrics)  # the loop fetches the loss anyway
        done[0] += 1
        record = StepRecord.of(done[0], plan, host, time.perf_counter() - start,
                               batches[index])
        if watch is not None:
            watch.step(record, state=state)  # its learning rate read off the state
        return state, metrics

    return Runner(run, state)


def step_memory(program: StepProgram, state: Any, batch: Any) -> int:
    """Per-device bytes of the compiled step: its arguments, its outputs less those that
    reuse donated arguments, and its temporaries (XLA's memory analysis)."""
    return compiled_bytes(program.step_fn.lower(state, batch, program.splits()).compile())


def expected_bubble(plan: Plan, model: ModelConfig) -> tuple[float, float]:
    """(closed form (pp-1)/(M_g+pp-1), perfmodel GPipe with compute-only costs)."""
    m_g = max(plan.microbatches_per_group)
    closed = (plan.pp - 1) / (m_g + plan.pp - 1)
    costs = CostParams(c=0.0, alpha=1e-9, beta=1e-12)  # free links: bubble from schedule only
    return closed, simulate_step(plan, model, costs, trace=False).bubble_fraction


def timed_step(runner: Runner, state: Any, index: int) -> tuple[Any, dict, float]:
    start = time.perf_counter()
    state, metrics = runner.step(state, index)
    jax.block_until_ready((state, metrics))
    return state, metrics, time.perf_counter() - start


def measure(runners: dict[str, Runner], n_batches: int, warmup: int,
            rounds: int) -> tuple[dict[str, list[float]], dict[str, dict]]:
    """Per-step seconds of each runner, interleaved round by round after warm-up."""
    states = {name: r.state for name, r in runners.items()}
    first: dict[str, dict] = {}
    for w in range(warmup):
        for name, runner in runners.items():
            states[name], metrics, _ = timed_step(runner, states[name], w % n_batches)
            first.setdefault(name, jax.device_get(metrics))
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(rounds):
        for name, runner in runners.items():
            states[name], _, seconds = timed_step(runner, states[name], r % n_batches)
            samples[name].append(seconds)
    return samples, first


def spread(values: list[float]) -> float:
    """Interquartile range relative to the median: how noisy a program's samples were."""
    q1, med, q3 = np.percentile(values, [25, 50, 75])
    return float((q3 - q1) / med)


def report(samples: dict, first: dict, plans: dict[str, Plan], model: ModelConfig,
           tokens: int, load: tuple[float, float], memory: dict[str, int]) -> dict[str, Any]:
    median = {name: float(np.median(s)) for name, s in samples.items()}
    tok_s = {name: tokens / t for name, t in median.items()}
    bubbles = {name: expected_bubble(plan, model) for name, plan in plans.items()}
    print(f"\n{'program':<14} {'step s':>8} {'IQR/med':>8} {'tokens/s':>10} {'vs 8/1/1':>9} "
          f"{'bubble':>7} {'perfmod':>7} {'1/(1-b)':>7} {'MB/dev':>7}")
    for name in samples:
        closed, sim = bubbles.get(name, (0.0, 0.0))
        mb = f"{memory[name] / 2**20:7.2f}" if name in memory else f"{'-':>7}"
        print(f"{name:<14} {median[name]:8.4f} {spread(samples[name]):8.3f} {tok_s[name]:10.0f} "
              f"{median[name] / median[BASE]:9.3f} {closed:7.3f} {sim:7.3f} "
              f"{1 / (1 - closed):7.3f} {mb}")
    loss_gap = max(abs(float(first[n]["loss"]) - float(first[PLAIN]["loss"])) for n in first)
    ratio = tok_s[BASE] / tok_s[PLAIN]
    paired = float(np.median(np.asarray(samples[PLAIN]) / np.asarray(samples[BASE])))
    with_metrics = tok_s[WATCHED] / tok_s[LOOP]
    metrics_paired = float(np.median(np.asarray(samples[LOOP]) / np.asarray(samples[WATCHED])))
    extra = {"ratio_vs_plain_jit_paired_rounds": round(paired, 4),
             "ratio_with_metrics": round(with_metrics, 4),
             "ratio_with_metrics_paired": round(metrics_paired, 4),
             "ratio_two_ticks_vs_plain_jit": round(tok_s[TICKS] / tok_s[PLAIN], 4)}
    if GSPMD in samples:
        extra["ratio_vs_plain_gspmd"] = round(tok_s[BASE] / tok_s[GSPMD], 4)
    print(f"\nfirst-step loss, all programs: {float(first[PLAIN]['loss']):.5f} "
          f"(max gap {loss_gap:.1e}); tokens/step {tokens}")
    print(f"load average before/after: {load[0]:.2f} / {load[1]:.2f} on {os.cpu_count()} cores")
    print(f"ratio ours(8/1/1) / plain jit, tokens/s: {ratio:.3f} of medians, {paired:.3f} "
          f"median of per-round ratios (target >= 0.95)")
    print(f"with / without metrics (TensorBoard + JSON lines, 8/1/1 as the loop runs it), "
          f"tokens/s: {with_metrics:.3f} of medians, {metrics_paired:.3f} median of per-round "
          f"ratios (IQR/med {spread(samples[LOOP]):.3f} without, {spread(samples[WATCHED]):.3f} "
          "with: the noise)")
    print("faults: none (all 8 devices healthy, no slowdown injected)")
    return {"ratio_vs_plain_jit": round(ratio, 4),
            "tokens_per_s": {n: round(v, 1) for n, v in tok_s.items()},
            "step_time_s": {n: round(v, 5) for n, v in median.items()},
            "bubble_fraction": {n: round(b[0], 4) for n, b in bubbles.items()},
            "bubble_fraction_perfmodel": {n: round(b[1], 4) for n, b in bubbles.items()},
            "iqr_over_median": {n: round(spread(s), 4) for n, s in samples.items()},
            **extra,
            "memory_bytes_per_device": memory,
            "first_step_loss_max_gap": loss_gap, "tokens_per_step": tokens,
            "loadavg_before_after": [round(x, 2) for x in load], "faults": "none"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, short run (< 2 min)")
    parser.add_argument("--model", choices=("small", "tiny"), default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--with-gspmd", action="store_true",
                        help="also time the partitioner-only plain baseline (slow)")
    args = parser.parse_args()
    model = get_model_config(args.model or ("tiny" if args.quick else "small"))
    seq_len, mb_size, n_mb = (64, 2, 16) if args.quick else (128, 1, 16)
    warmup, rounds = (2, 7) if args.quick else (2, 7)
    train = StepConfig()
    devices = jax.devices()
    if len(devices) != 8:
        raise SystemExit(f"need 8 devices, found {len(devices)} (XLA_FLAGS set too late?)")
    data = BatchIterator("synthetic:lognormal", n_microbatches=n_mb, microbatch_size=mb_size,
                         seq_len=seq_len, seed=args.seed)
    batches = [data.next_batch() for _ in range(2)]
    print(f"model={model.name} ({model.param_count() / 1e6:.2f}M params, {model.dtype}), "
          f"global batch {n_mb} micro-batches x {mb_size} rows x {seq_len} tokens, "
          f"{warmup} warm-up + {rounds} interleaved rounds, jax {jax.__version__}")
    plans = {name_of(*s): Plan.uniform(*s, n_layers=model.n_layers, n_microbatches=n_mb,
                                       microbatch_size=mb_size, seq_len=seq_len)
             for s in SHAPES}
    plans[TICKS] = plans[BASE]
    plans[BASE] = Plan.uniform(8, 1, 1, n_layers=model.n_layers, n_microbatches=8,
                               microbatch_size=n_mb * mb_size // 8, seq_len=seq_len)
    plans = {name: plans[name] for name in (BASE, TICKS, *list(plans)[1:len(SHAPES)])}
    runners: dict[str, Runner] = {}
    memory: dict[str, int] = {}
    scratch = tempfile.mkdtemp(prefix="healthy-throughput-metrics-")
    for name, plan in plans.items():
        # No empty headroom ticks: the plan is fixed here, as `resihp train` does it.
        fitted = train.replace(microbatch_slots=max(plan.microbatches_per_group))
        runners[name], program, memory[name] = plan_runner(plan, model, fitted, batches,
                                                           args.seed)
        print(f"  {name}: {plan.describe()} mb_slots={program.mb_slots} "
              f"ticks={program.mb_slots + plan.pp - 1} layer_slots={program.layer_slots}")
        if name == BASE:  # plain right after ours: the A, B pair leads every round
            runners[PLAIN] = plain_runner(model, devices, batches, args.seed, False)
            step = runners[BASE].step  # the same program, a state of each loop's own
            runners[LOOP] = loop_runner(step, program.init_state(args.seed), plan, batches)
            watch = RunMetrics(Metrics([f"tensorboard:{scratch}/tb", f"{scratch}/m.jsonl"]),
                               model, optimizer_learning_rate)
            runners[WATCHED] = loop_runner(step, program.init_state(args.seed), plan, batches,
                                           watch)
            if args.with_gspmd:
                runners[GSPMD] = plain_runner(model, devices, batches, args.seed, True)
    load_before = os.getloadavg()[0]
    samples, first = measure(runners, len(batches), warmup, rounds)
    watch.close()
    shutil.rmtree(scratch, ignore_errors=True)
    result = report(samples, first, plans, model, n_mb * mb_size * seq_len,
                    (load_before, os.getloadavg()[0]), memory)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
