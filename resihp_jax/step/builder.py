"""The one step builder: the jitted train step of any NNX model that keeps the contract
(step/model_parts.py) under any Plan, as a `StepProgram`, so every split, re-plan and state
move works alike for a user's model and a preset of `rh.models.Llama`. The state's blocks
are in the stage layout `[pp, slots, ...]`; shardings come from the parameters' logical
names and `axis_rules`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from resihp_jax.errors import PlanError
from resihp_jax.meshes import layout
from resihp_jax.meshes.mesh import make_mesh
from resihp_jax.plan import Plan
from resihp_jax.meshes.rules import spread_spec
from resihp_jax.step.config import StepConfig
from resihp_jax.step.instrument import Instrument
from resihp_jax.step.pipeline import ALL_AXES, STEP_AXES
from resihp_jax.step.program import (KNOB_SPEC, Batch, Splits, StepProgram, TrainState,
                                   canonical_state_shapes, fresh_state, step_functions)
from resihp_jax.step.model_parts import (DEFAULT_AXIS_RULES, ModelParts, check_divisible,
                                         fully_manual, mesh_specs, split_model)
from resihp_jax.step.body import pipeline_loss_sum


def param_specs(parts: ModelParts, rules: Sequence[tuple[str, str | None]],
                stage_layout: bool) -> dict[str, Any]:
    lead = ("pp", None) if stage_layout else (None,)
    return {"shell": mesh_specs(parts.shell_logical, rules),
            "blocks": jax.tree.map(lambda s: P(*lead, *s),
                                   mesh_specs(parts.layer_logical, rules),
                                   is_leaf=lambda x: isinstance(x, P))}


def _state_specs(shapes: TrainState, params: dict[str, Any]) -> TrainState:
    """Specs of a whole state: optimizer moments are sharded like the parameters they mirror,
    everything else (counts) replicated."""
    # a part of the optimizer's state shaped like the parameters mirrors them (optax's
    # tree_map_params tells them apart by running `init` eagerly: an injected hyper-parameter
    # then compiles a dozen one-op executables before the first step)
    layout = jax.tree.structure(shapes.params)
    mirrors = lambda x: jax.tree.structure(x) == layout  # noqa: E731
    opt = jax.tree.map(lambda x: params if mirrors(x) else P(), shapes.opt_state,
                       is_leaf=mirrors)
    return TrainState(P(), params, opt)


def build_model_step(parts: ModelParts, optimizer: optax.GradientTransformation, plan: Plan,
                    devices: Sequence[jax.Device], example_params: Any, *,
                    axis_rules: Sequence[tuple[str, str | None]] = DEFAULT_AXIS_RULES,
                    train: StepConfig | None = None,
                    initial_params: Callable[[int], Any] | None = None,
                    compute_dtype: str | None = None,
                    instrument: Instrument | None = None,
                    gates: str = "cond") -> StepProgram:
    """Compile-ready program of a user's model for `plan` on `devices`.

    `example_params`: canonical parameters (arrays or shapes) fixing every leaf's shape.
    `compute_dtype` ('bfloat16'): the model computes in it from float32 master weights; the
    loss stays float32. `instrument` (steps manual over every mesh axis: tp == 1, or manual
    tensor parallelism) brackets each device's stage work with host callbacks. `gates`: how
    the pipeline skips idle work (step/body.py); a "cond" program whose compiled step would
    hang becomes a "select" one (`StepProgram.adopt_compiled`)."""
    train = train or StepConfig()
    if plan.n_layers != parts.n_layers:
        raise PlanError(f"Plan.layers_per_stage={plan.layers_per_stage} sums to "
                        f"{plan.n_layers} layers; the model has {parts.n_layers} blocks")
    if instrument is not None and not fully_manual(parts, plan):
        raise PlanError(f"an Instrument reaches a user's model only under plans with tp == 1 "
                        f"or with tensor_parallel='manual' (host callbacks need every mesh "
                        f"axis manual); this plan has tp={plan.tp} and the model "
                        f"tensor_parallel={parts.tensor_parallel!r}")
    mesh = make_mesh(plan, devices)
    canonical_specs = param_specs(parts, axis_rules, stage_layout=False)
    check_divisible(example_params, canonical_specs, dict(mesh.shape), "model parameter ")
    layer_slots = layout.layer_slots_for(plan, train.layer_slots)
    mb_slots = layout.microbatch_slots_for(plan, train.microbatch_slots)
    index_PxL = layout.stage_index(plan.layers_per_stage, layer_slots)  # numpy, no compile
    shapes = jax.eval_shape(lambda p: fresh_state(optimizer, p, index_PxL), example_params)
    specs = _state_specs(shapes, param_specs(parts, axis_rules, stage_layout=True))
    named = lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), tree,  # noqa: E731
                                      is_leaf=lambda x: isinstance(x, P))
    shardings = named(specs)
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P("dp"))
    loss_sum = _sharded_loss_sum(parts, plan, mesh, specs.params, train, compute_dtype,
                                 instrument, gates)
    step_fn, grads_fn = step_functions(loss_sum, optimizer, shardings, mesh, train.donate_state)
    canonical = canonical_state_shapes(shapes, parts.n_layers)
    # outside the step the layers are spread over dp x pp (meshes/rules.py spread_spec)
    canonical_sh = named(_state_specs(canonical, _spread(
        parts, canonical_specs, example_params, dict(mesh.shape), lead=1)))
    spread_stage = named(_state_specs(shapes, _spread(
        parts, specs.params, shapes.params, dict(mesh.shape), lead=2)))

    def canonical_of(state: TrainState, positions_L: jax.Array) -> TrainState:
        # each layer spread over dp x pp first (an all-to-all): the gather of layers is then
        # local to each device, and no device ever holds more than its share (a gather out
        # of a pp-sharded operand becomes masked local gathers plus an all-reduce of the
        # whole result, several times the traffic)
        state = jax.lax.with_sharding_constraint(state, spread_stage)
        return layout.to_canonical_layout(state, positions_L)

    to_canonical_fn = jax.jit(canonical_of, in_shardings=(shardings, replicated),
                              out_shardings=canonical_sh)
    to_stage_fn = jax.jit(layout.to_stage_layout, in_shardings=(canonical_sh, replicated),
                          out_shardings=shardings)
    # a new split of the same mesh: each device builds only its own stage's slots (the old
    # state donated, as the step donates it)
    restage_fn = jax.jit(
        lambda s, pos, idx: layout.to_stage_layout(canonical_of(s, pos), idx),
        in_shardings=(shardings, replicated, replicated), out_shardings=shardings,
        donate_argnums=0 if train.donate_state else ())
    train = train.replace(layer_slots=layer_slots, microbatch_slots=mb_slots)
    return StepProgram(parts, train, plan, mesh, layer_slots, mb_slots, optimizer,
                           shardings, batch_sharding, replicated, step_fn, grads_fn,
                           canonical_sh, to_canonical_fn, to_stage_fn, restage_fn,
                           param_specs=canonical_specs, state_shapes=shapes,
                           initial_params=initial_params, gates=gates, loss_sum_fn=loss_sum,
                           selecting=None if gates == "select" else functools.partial(
                               build_model_step, parts, optimizer, plan, devices,
                               example_params, axis_rules=axis_rules, train=train,
                               initial_params=initial_params, compute_dtype=compute_dtype,
                               instrument=instrument, gates="select"))


def _spread(parts: ModelParts, specs: dict[str, Any], params: dict[str, Any],
            sizes: dict[str, int], lead: int) -> dict[str, Any]:
    """Parameter specs `{"shell", "blocks"}` with every block leaf spread over dp and pp
    (`spread_spec`); `params`: their shapes, with `lead` layer dims."""
    blocks = jax.tree.map(lambda logical, spec, x: spread_spec(logical, spec, x.shape, sizes, lead),
                          parts.layer_logical, specs["blocks"], params["blocks"],
                          is_leaf=lambda x: isinstance(x, P))
    return {"shell": specs["shell"], "blocks": blocks}


def _sharded_loss_sum(parts: ModelParts, plan: Plan, mesh: jax.sharding.Mesh, specs: Any,
                      train: StepConfig, compute_dtype: str | None,
                      instrument: Instrument | None,
                      gates: str) -> Callable[[Any, Batch, Splits, jax.Array], jax.Array]:
    """(params, batch, splits, step) -> the batch's summed token losses, the per-device body
    in a shard_map manual over every axis (tp == 1 or manual tensor parallelism: the knobs
    go in), else over 'dp' and 'pp', or none at dp = pp = 1 (step/body.py says why)."""
    manual = fully_manual(parts, plan)
    axes = ALL_AXES if manual else STEP_AXES if plan.dp * plan.pp > 1 else ()
    body = functools.partial(pipeline_loss_sum, parts=parts, pp=plan.pp,
                             remat=train.remat, compute_dtype=compute_dtype, axes=axes,
                             instrument=instrument, gates=gates,
                             vocab_tp=plan.tp if manual else 1,
                             loss_chunks=train.loss_chunks)
    batch_specs = (P("dp"),) * 3
    # the state's step rides along (replicated): a model's random streams draw from it
    if axes == ALL_AXES:  # every axis manual: the parameters' whole specs, tp included
        sharded = jax.shard_map(
            lambda p, t, s, q, n, m, k, step: body(p, t, s, q, n, m, k, step=step),
            mesh=mesh, in_specs=(specs, *batch_specs, P(), P(), KNOB_SPEC, P()),
            out_specs=P())
        return lambda params, batch, splits, step: sharded(
            params, *batch, splits.layers_per_stage, splits.microbatches_per_group,
            splits.knobs, step)
    run = lambda p, t, s, q, n, m, step: body(p, t, s, q, n, m, step=step)  # noqa: E731
    if axes == STEP_AXES:  # a parameter's 'tp' sharding travels on its NamedSharding
        manual = jax.tree.map(lambda s: P(*s[:1]) if s and s[0] == "pp" else P(), specs,
                              is_leaf=lambda x: isinstance(x, P))
        run = jax.shard_map(run, mesh=mesh, in_specs=(manual, *batch_specs, P(), P(), P()),
                            out_specs=P(), axis_names=set(STEP_AXES))
    return lambda params, batch, splits, step: run(
        params, *batch, splits.layers_per_stage, splits.microbatches_per_group, step)


def initializer(program: StepProgram, model: Any,
                params: dict[str, Any]) -> Callable[[int], Any]:
    """seed -> the canonical parameters training starts from: a built model's own (`model`
    an nnx.Module, `params` its parameters), or a model function's, built inside one program
    straight into `program`'s shardings (never whole on one device)."""
    if isinstance(model, nnx.Module):
        return lambda seed: params

    def initial(seed: int) -> Any:
        def build() -> dict[str, Any]:
            with nnx.use_eager_sharding(False):
                _, shell, blocks = split_model(model(nnx.Rngs(seed)))
            return {"shell": shell, "blocks": blocks}

        return jax.jit(build, out_shardings=program.canonical_shardings.params)()

    return initial
