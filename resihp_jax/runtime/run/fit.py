"""`rh.fit`: train the user's own Flax NNX model on the user's data, resiliently, in one call.

The model keeps its own class and code; the library stacks its blocks into the pipeline's
layer layout, maps its logical axis names to the mesh, computes the next-token loss and runs
the ResilientTrainer's loop (detector, scheduler, switches, checkpoints) over it. The trained
model comes back as an instance of the user's class.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax

from resihp_jax.data import BatchIterator, packed_batches
from resihp_jax.errors import ConfigError, Preempted, StepHung
from resihp_jax.plan import Plan
from resihp_jax.runtime.job.distributed import job_spec
from resihp_jax.runtime.job.exits import HUNG_EXIT, run_as_job_process
from resihp_jax.runtime.job.join import join_job
from resihp_jax.env_vars import CHECKPOINT_DIR_ENV, LOCAL_COPY_DIR_ENV
from resihp_jax.metrics.destinations import launched_metrics
from resihp_jax.perfmodel.costs import REMAT_AUTO
from resihp_jax.perfmodel.memory import devices_memory_gb
from resihp_jax.runtime.run.auto_plan import auto_plan, auto_plan_and_remat
from resihp_jax.runtime.replicas.launched import replicas_in_job
from resihp_jax.runtime.config import RESUME_FORCE, ResilienceConfig, RunConfig, check_metrics
from resihp_jax.runtime.recovery.checkpoint_dir import refuse_held
from resihp_jax.runtime.run.training import TrainingRun
from resihp_jax.runtime.run.programs import read_facts, model_programs
from resihp_jax.runtime.programs.compiles import install
from resihp_jax.runtime.events import Replan, StepRecord
from resihp_jax.runtime.trainer.overhead import Overhead
from resihp_jax.step.config import StepConfig
from resihp_jax.step.facts import MeasuredFacts
from resihp_jax.step.model_parts import DEFAULT_AXIS_RULES


@dataclass(frozen=True)
class FitResult:
    """What `fit` trained: the model (the user's class), each step's loss, the re-plans."""
    model: Any
    losses: dict[int, float]  # step (from 1) -> loss, for the steps this call trained
    replans: list[Replan] = field(default_factory=list)
    records: list[StepRecord] = field(default_factory=list)
    facts: MeasuredFacts | None = None  # what the planner knew of the model
    plan: Plan | None = None  # the plan the last step ran
    first_plan: Plan | None = None  # the plan training started on
    # what resilience cost this call (checkpoints, probes, timing, copies against wall time;
    # `.describe()` is the end-of-run line)
    overhead: Overhead | None = None


def fit(model: Any, data: Any, *, optimizer: optax.GradientTransformation, plan: Plan | str,
        steps: int, seed: int = 0, devices: Sequence[jax.Device] | None = None,
        checkpoint_dir: str | None = None, resilience: ResilienceConfig | None = None,
        axis_rules: Sequence[tuple[str, str | None]] = DEFAULT_AXIS_RULES,
        on_step: Callable[[StepRecord], None] | None = None, progress: bool | None = None,
        attention_cost: str | None = None, remat: bool | str = "auto",
        compute_dtype: str | None = None, metrics: Any = None,
        profile_steps: tuple[int, int] | None = None,
        resume: bool | str = True) -> FitResult:
    """Train `model` for `steps` steps under `plan` and return the trained model.

    model: an `nnx.Module` with `embed(tokens, positions)`, `blocks` (identical blocks,
        `block(h, segment_ids, positions)`) and `head(h)`, its kernels named with
        `nnx.with_partitioning`; or a function `rngs -> model`, then built sharded (never
        whole on one device).
    data: a sequence of `rh.PackedBatch` (rows = plan's micro-batches x micro-batch size),
        a function returning an iterator of them, a document source (`rh.data.from_documents`,
        `rh.data.TokenFileSource`, ...) that the library packs, or a `BatchIterator`.
    optimizer: any optax transformation, applied as given.
    plan: an `rh.Plan`, or "auto": the scheduler's fastest plan for the devices present and
        the batches' rows and length (data must then be a sequence of rh.PackedBatch);
        `result.plan` says which it chose.
    on_step: called after every step with its StepRecord (`.step`, `.loss`, ...).
    compute_dtype: None (the parameters' own dtype, float32) or 'bfloat16' (bf16 compute from
        float32 master weights; loss, softmax statistics and gradients in float32).
    metrics: where process 0 writes, off the loop's path: 'tensorboard:DIR', 'wandb:PROJECT',
        'jsonl:PATH' (or a path), an object with `write(entry)`, or a list (default:
        $RESIHP_METRICS, from `resihp launch --metrics`).
    profile_steps: (first, end): a jax.profiler trace of steps first..end-1 into the metrics
        directory (TensorBoard's profile tab); `kill -USR2` traces the next 3 steps anyway.
    resume: True continues from checkpoint_dir's newest state, refusing another run's (a
        changed model, optimizer, data or batch shape: CheckpointError naming it); 'force'
        continues even then, naming what differed; False starts from step 0, refusing a
        directory that holds checkpoints and a job's process (a relaunched one must continue).
    remat: what the backward recomputes: False or "none", "projections" (keeps the matmuls'
        outputs and the attention output a model names "context"), True or "full" (each
        stage's forward); "auto" (default): per plan, the first of those whose compiled step
        fits the devices' memory (theirs, or `resilience.device_memory_gb`); said once.
    """
    install()  # the start-up count includes the model's split and facts below
    started = time.time()
    _check_args(steps, plan, optimizer)
    train = StepConfig(remat=remat)  # checks remat, naming every valid value
    metrics = metrics if metrics is not None else launched_metrics()
    check_metrics(metrics, profile_steps)
    if not (isinstance(resume, bool) or resume == RESUME_FORCE):
        raise ConfigError(f"resume={resume!r}: valid are True (continue from checkpoint_dir's "
                          "newest state of this same run), False (start from step 0; "
                          f"checkpoint_dir must hold no checkpoint) and {RESUME_FORCE!r} "
                          "(continue even from another run's)")
    if compute_dtype not in (None, "float32", "bfloat16"):
        raise ConfigError(f"compute_dtype={compute_dtype!r}: valid are None, 'float32', "
                          "'bfloat16'")
    resilience = resilience or ResilienceConfig(compile_cache_dir=None)
    if not isinstance(resilience, ResilienceConfig):
        raise ConfigError(f"resilience: expected an rh.ResilienceConfig, got "
                          f"{type(resilience).__name__}")
    if resilience.checkpoint_dir is not None:
        if checkpoint_dir is not None and checkpoint_dir != resilience.checkpoint_dir:
            raise ConfigError(f"checkpoint_dir={checkpoint_dir!r} and resilience.checkpoint_dir="
                              f"{resilience.checkpoint_dir!r}: give it once")
        checkpoint_dir = resilience.checkpoint_dir
    spec = job_spec()
    if not spec.single:  # a job's process: the job's directory unless one is given
        checkpoint_dir = checkpoint_dir or os.environ.get(CHECKPOINT_DIR_ENV)
        if resume is False:
            raise ConfigError(f"resume=False in a job ({spec.describe()}): a process the "
                              "job relaunches after a failure must continue from its "
                              "checkpoints; leave resume=True (a new job on an empty "
                              "checkpoint directory starts from step 0)")
        join_job(checkpoint_dir)  # before anything below starts JAX
    if resume is False and checkpoint_dir is not None:
        refuse_held(checkpoint_dir, f"resume=False but checkpoint_dir={checkpoint_dir!r}",
                    "pass resume=True")
    local_copy_dir = (resilience.local_copy_dir or os.environ.get(LOCAL_COPY_DIR_ENV)) \
        if checkpoint_dir else None
    programs = model_programs(model, optimizer, seed, axis_rules=axis_rules,
                             compute_dtype=compute_dtype)
    parts = programs.parts
    facts = read_facts(programs, _seq_len(plan, data), attention_cost)
    if isinstance(plan, str):  # "auto", checked above
        plan = _auto_plan(facts, remat, data, devices or jax.devices(),
                          resilience.device_memory_gb)
    # the one settings tree, passed down unchanged: the user's resilience settings with the
    # places this call resolved (the job's directory, the node-local copies)
    config = RunConfig(
        metrics=metrics, profile_steps=profile_steps, steps=steps, seed=seed,
        data=type(data).__name__, resume=resume if checkpoint_dir is not None else False,
        progress=sys.stderr.isatty() if progress is None else progress,
        survivor_copies="auto" if checkpoint_dir is not None else "off",
        resilience=resilience.replace(checkpoint_dir=checkpoint_dir,
                                      local_copy_dir=local_copy_dir))
    training = TrainingRun(facts, train, plan, config, spec, data=_batches(data, plan, seed),
                           programs=programs, on_step=on_step, devices=devices,
                           compiles_from=started)
    fetched: dict[str, Any] = {}

    def train_and_fetch() -> None:
        training.run()
        # the parameters in canonical order, fetched to host: in a job a collective, so a
        # peer lost here ends the process like one lost in a step (run_as_job_process)
        fetched["params"] = training.result.canonical_params()

    if spec.single:
        try:
            train_and_fetch()
        except Preempted as err:  # SIGTERM: the step under way was saved; leave as asked
            print(f"rh.fit: {err}", file=sys.stderr, flush=True)
            raise SystemExit(err.EXIT) from None
        except StepHung as err:  # the devices are held for good: end now, never hang
            print(f"rh.fit: {err}; exiting", file=sys.stderr, flush=True)
            os._exit(HUNG_EXIT)
    else:  # a failure must end the process at once, with the code the job restarts on
        run_as_job_process(train_and_fetch, "rh.fit")
    result, canonical = training.result, fetched["params"]
    return FitResult(parts.assemble(canonical["shell"], canonical["blocks"]),
                     {r.step: r.loss for r in result.records}, result.replans,
                     result.records, facts, result.plan, plan, result.overhead)


def _auto_plan(facts: MeasuredFacts, remat: bool | str, data: Any,
               devices: Sequence[jax.Device], memory_gb: float | None) -> Plan:
    """The scheduler's plan for the devices' memory (the given figure, else their own); with
    `remat="auto"` the fastest under the least recomputing policy that admits one (the
    trainer then compiles each plan's step under the least recomputing policy it fits)."""
    memory_gb = memory_gb or devices_memory_gb(devices)
    ids = [d.id for d in devices]
    rows, seq_len = _batch_shape(data)
    if remat == REMAT_AUTO:
        return auto_plan_and_remat(facts, ids, rows, seq_len, device_memory_gb=memory_gb)[0]
    return auto_plan(facts, ids, rows, seq_len, device_memory_gb=memory_gb, remat=remat)[0]


def _check_args(steps: int, plan: Any, optimizer: Any) -> None:
    if isinstance(plan, str) and plan != "auto":
        raise ConfigError(f"plan={plan!r}: give an rh.Plan (e.g. rh.Plan.uniform(dp, pp, tp, "
                          "n_layers=..., n_microbatches=..., microbatch_size=..., seq_len=...)) "
                          "or 'auto'")
    if not isinstance(plan, (Plan, str)):
        raise ConfigError(f"plan: expected an rh.Plan, got {type(plan).__name__}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ConfigError(f"steps={steps!r}: must be an integer >= 1")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise ConfigError(f"optimizer: expected an optax GradientTransformation, got "
                          f"{type(optimizer).__name__}")


def _seq_len(plan: Plan | str, data: Any) -> int | None:
    """The training rows' length: the plan's, else the first batch's (None when unknown)."""
    if isinstance(plan, Plan):
        return plan.seq_len
    try:
        return _batch_shape(data)[1]
    except ConfigError:
        return None  # plan="auto" on other data is refused below, naming the data


def _batch_shape(data: Any) -> tuple[int, int]:
    """(rows, seq_len) of the user's batches, for plan='auto' (read off the first one)."""
    if isinstance(data, Sequence) and len(data) and hasattr(data[0], "tokens"):
        shape = tuple(np.shape(data[0].tokens))
        if len(shape) == 2 and min(shape) > 0:
            return int(shape[0]), int(shape[1])
        raise ConfigError(f"data[0].tokens has shape {shape}: expected [rows, seq_len]")
    raise ConfigError(f"plan='auto' reads the batch shape off a sequence of rh.PackedBatch; "
                      f"data is a {type(data).__name__}: give an rh.Plan for it")


def _batches(data: Any, plan: Plan, seed: int) -> Any:
    # in a job of replicas each step's global batch is every replica's plan's micro-batches
    shape = dict(n_microbatches=plan.n_microbatches * replicas_in_job(),
                 microbatch_size=plan.microbatch_size, seq_len=plan.seq_len)
    if hasattr(data, "next_batch") and hasattr(data, "state") and hasattr(data, "restore"):
        return data  # an iterator of ours (or one like it)
    if all(hasattr(data, m) for m in ("item", "item_size", "items_per_epoch", "fingerprint")):
        return BatchIterator(data, seed=seed, **shape)
    if callable(data) or isinstance(data, Sequence):
        return packed_batches(data, **shape)
    raise ConfigError(f"data: expected a sequence of rh.PackedBatch, a function returning an "
                      f"iterator of them, or a document source; got {type(data).__name__}")
