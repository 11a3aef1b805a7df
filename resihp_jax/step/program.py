"""The program of one model on one mesh (`StepProgram`): the jitted step, its
loss-and-gradients, the layout moves, and the check a compiled step passes before it runs.
The splits are runtime inputs (`Splits`): only a new mesh or slot count builds a new program.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from resihp_jax.attention.check import check_traced
from resihp_jax.errors import PlanError
from resihp_jax.meshes import layout
from resihp_jax.meshes.branch_collectives import BranchCollective, branch_collectives
from resihp_jax.meshes.mesh import put_global
from resihp_jax.plan import Plan
from resihp_jax.nn import layers
from resihp_jax.perfmodel.costs import remat_name
from resihp_jax.perfmodel.memory import compiled_bytes, devices_memory_gb
from resihp_jax.step.config import StepConfig
from resihp_jax.step.model_parts import fully_manual
from resihp_jax.step.param_gathers import parameter_gathers, warn_parameter_gathers


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: dict[str, Any]  # stage layout: layer leaves [pp, slots, ...]
    opt_state: Any


class Batch(NamedTuple):
    """A global batch routed to DP groups: each [dp, mb_slots, microbatch_size, seq_len]."""
    tokens: jax.Array
    segment_ids: jax.Array
    positions: jax.Array


class Splits(NamedTuple):
    """Runtime inputs that never recompile: layers per stage [pp], micro-batches per DP
    group [dp], and one float per device [dp, pp, tp] for the instrument (default 1)."""
    layers_per_stage: jax.Array
    microbatches_per_group: jax.Array
    knobs: jax.Array


KNOB_SPEC = P("dp", "pp", "tp")


def route_microbatches(array_MxBxS: np.ndarray, plan: Plan, mb_slots: int) -> np.ndarray:
    """Global micro-batches [M, B, S] -> per-group slots [dp, mb_slots, B, S] (zero padded)."""
    if array_MxBxS.shape[0] != plan.n_microbatches:
        raise ValueError(f"batch has {array_MxBxS.shape[0]} micro-batches; the plan takes "
                         f"{plan.n_microbatches}")
    return routed_groups(lambda m: array_MxBxS[m], array_MxBxS.shape[1:], array_MxBxS.dtype,
                         plan, mb_slots, range(plan.dp))


def routed_groups(read_microbatch: Callable[[int], np.ndarray], mb_shape: tuple[int, ...],
                  dtype: Any, plan: Plan, mb_slots: int, groups: range) -> np.ndarray:
    """The slots [len(groups), mb_slots, B, S] of these DP groups, reading only the
    micro-batches routed to them (zero padded)."""
    out = np.zeros((len(groups), mb_slots) + tuple(mb_shape), dtype)
    offsets = plan.microbatch_offsets()
    for i, group in enumerate(groups):
        start, count = offsets[group], plan.microbatches_per_group[group]
        for slot in range(count):
            out[i, slot] = read_microbatch(start + slot)
    return out


def token_count(segment_ids: jax.Array) -> jax.Array:
    """Trained tokens in a batch of any leading shape (the loss's denominator)."""
    seg_NxS = segment_ids.reshape(-1, segment_ids.shape[-1])
    return jnp.sum(layers.next_token_targets(seg_NxS, seg_NxS)[1])


class OverMemoryWarning(UserWarning):
    """A compiled step asks for more memory than its devices have."""


class SelectedGatesWarning(UserWarning):
    """A user's model's step runs its pipeline gates by selection (see `adopt_compiled`)."""


@dataclass(frozen=True)
class StepProgram:
    """Everything compiled for one mesh; `plan` may change splits without rebuilding."""
    model: Any  # the model's parts (step/model_parts.py ModelParts)
    train: StepConfig
    plan: Plan
    mesh: jax.sharding.Mesh
    layer_slots: int
    mb_slots: int
    optimizer: optax.GradientTransformation
    state_shardings: Any
    batch_sharding: NamedSharding
    replicated: NamedSharding
    step_fn: Callable[..., Any]
    loss_and_grads_fn: Callable[..., Any]
    canonical_shardings: Any  # the state with layers `[n_layers, ...]`, on this mesh
    to_canonical_fn: Callable[..., Any]  # (state, positions_L) -> canonical state
    to_stage_fn: Callable[..., Any]  # (canonical state, index_PxL) -> state
    restage_fn: Callable[..., Any]  # (state, old positions_L, new index_PxL) -> state
    param_specs: Any = None  # mesh PartitionSpecs of {"shell", "blocks"} (canonical blocks)
    state_shapes: Any = None  # the state's shapes in the stage layout
    # seed -> canonical parameters: what `init_state(seed)` starts from (the user's model)
    initial_params: Callable[[int], Any] | None = None
    gates: str = "cond"  # how the pipeline skips idle work (step/body.py: GATES)
    # (params, batch, splits, step) -> the batch's summed token losses: what the step
    # differentiates, and what replicas build their two-program step on (runtime/replicas/)
    loss_sum_fn: Callable[..., Any] | None = None
    selecting: Callable[[], StepProgram] | None = None  # gates by selection (adopt_compiled)
    # the splits placed on the devices, by split and knobs, reused rather than copied to the
    # devices each step (shared by `with_plan` copies: the key holds the split)
    _placed: dict = field(default_factory=dict, compare=False, repr=False)

    def accepts(self, plan: Plan) -> bool:
        """Can this program run `plan` as it is (same mesh, splits within its slots)?"""
        return (self.plan.same_mesh(plan) and max(plan.layers_per_stage) <= self.layer_slots
                and max(plan.microbatches_per_group) <= self.mb_slots)

    def with_plan(self, plan: Plan) -> StepProgram:
        """Same program (compiled executables included) for a plan that only changes the
        layer or micro-batch split."""
        if not self.plan.same_mesh(plan):
            raise ValueError("with_plan needs the same mesh; build a new program instead")
        layout.layer_slots_for(plan, self.layer_slots)
        layout.microbatch_slots_for(plan, self.mb_slots)
        return dataclasses.replace(self, plan=plan)

    def stage_index_array(self) -> jax.Array:
        return put_global(self.stage_index(), self.replicated)

    def splits(self, knobs_DxPxT: np.ndarray | None = None) -> Splits:
        if knobs_DxPxT is None:
            knobs_DxPxT = np.ones((self.plan.dp, self.plan.pp, self.plan.tp), np.float32)
        knobs_DxPxT = np.asarray(knobs_DxPxT, np.float32)
        key = (self.plan.layers_per_stage, self.plan.microbatches_per_group,
               knobs_DxPxT.tobytes())
        if key not in self._placed:
            if len(self._placed) >= 16:  # (injected faults vary the knobs step by step)
                self._placed.clear()
            put = functools.partial(put_global, sharding=self.replicated)
            self._placed[key] = Splits(
                put(np.asarray(self.plan.layers_per_stage, np.int32)),
                put(np.asarray(self.plan.microbatches_per_group, np.int32)),
                put_global(knobs_DxPxT, NamedSharding(self.mesh, KNOB_SPEC)))
        return self._placed[key]

    def stage_index(self) -> np.ndarray:
        return layout.stage_index(self.plan.layers_per_stage, self.layer_slots)

    def canonical_positions(self) -> jax.Array:
        """[n_layers]: where each canonical layer sits in the flattened stage layout."""
        return put_global(layout.canonical_index(self.stage_index()), self.replicated)

    def shard_batch(self, tokens_MxBxS: np.ndarray, segment_ids_MxBxS: np.ndarray,
                    positions_MxBxS: np.ndarray) -> Batch:
        tokens_MxBxS = np.asarray(tokens_MxBxS, np.int32)
        return self.shard_microbatches(lambda m: tokens_MxBxS[m], segment_ids_MxBxS,
                                       positions_MxBxS)

    def shard_microbatches(self, read_tokens: Callable[[int], np.ndarray],
                           segment_ids_MxBxS: np.ndarray, positions_MxBxS: np.ndarray
                           ) -> Batch:
        """The batch on this mesh, its tokens read per micro-batch (`read_tokens(m)` ->
        [B, S]) and only for the DP groups whose devices this process holds: on a multi-host
        job each host reads its own micro-batches only. Segment ids and positions (the
        layout, known everywhere) are placed the same way."""
        layout_arrays = (route_microbatches(np.asarray(a, np.int32), self.plan, self.mb_slots)
                         for a in (segment_ids_MxBxS, positions_MxBxS))
        mb_shape = tuple(np.shape(segment_ids_MxBxS)[1:])
        global_shape = (self.plan.dp, self.mb_slots) + mb_shape

        read: dict[range, np.ndarray] = {}  # every device of a group asks for its slots

        def tokens_of(index: tuple[slice, ...]) -> np.ndarray:
            groups = range(self.plan.dp)[index[0]]  # the batch is sharded over dp only
            if groups not in read:
                read[groups] = routed_groups(read_tokens, mb_shape, np.int32, self.plan,
                                             self.mb_slots, groups)
            return read[groups][(slice(None),) + tuple(index[1:])]

        tokens = jax.make_array_from_callback(global_shape, self.batch_sharding, tokens_of)
        return Batch(tokens, *(put_global(a, self.batch_sharding) for a in layout_arrays))

    def step(self, state: TrainState, batch: Batch, knobs_DxPxT: np.ndarray | None = None
             ) -> tuple[TrainState, dict[str, jax.Array]]:
        return self.step_fn(state, batch, self.splits(knobs_DxPxT))

    def loss_and_grads(self, params: dict[str, Any], batch: Batch) -> tuple[jax.Array, Any]:
        return self.loss_and_grads_fn(params, batch, self.splits())

    def abstract_state(self) -> TrainState:
        return self.state_shapes

    def init_state(self, seed: Any) -> TrainState:
        """State from `initial_params(seed)` (an int) or from canonical parameters given in
        its place, placed straight into this program's shardings."""
        params = seed
        if isinstance(seed, int):
            if self.initial_params is None:
                raise ValueError("this program has no initial parameters: pass them")
            params = self.initial_params(seed)
        return jax.jit(functools.partial(fresh_state, self.optimizer),
                       out_shardings=self.state_shardings)(params, self.stage_index())

    def adopt_compiled(self, compiled_step: Any, *, warn_over_memory: bool = True
                       ) -> StepProgram:
        """Check the compiled step before it ever runs, and return the program to run:
        - pipeline branches holding a collective some devices never reach (a hang) switch
          to gates by selection (SelectedGatesWarning), or PlanError when there are none;
        - the traced attention kernels are checked against the dense reference (a kernel
          that leaks across documents is refused before the first step);
        - each tp-sharded parameter gathered whole is named (ParameterGatherWarning);
        - a step needing more memory than its devices have is named (OverMemoryWarning)
          unless `warn_over_memory` is False (runtime/trainer/remat_choice.py steps up
          the remat policy instead)."""
        hlo = compiled_step.as_text() if self.plan.tp > 1 else ""  # (once: a large text)
        if self.plan.tp > 1:
            hanging = branch_collectives(hlo, self.plan.tp)
            if hanging:
                return self._without_branches(hanging)
        check_traced(next(d for d in self.mesh.devices.flat  # (one of this process's)
                          if d.process_index == jax.process_index()))
        if self.plan.tp > 1 and not fully_manual(self.model, self.plan):
            # (a manual model's blocks get their shards: nothing is gathered behind them)
            canonical = canonical_state_shapes(self.state_shapes, self.plan.n_layers).params
            warn_parameter_gathers(
                parameter_gathers(hlo, canonical, self.param_specs),
                self.plan.tp)
        if warn_over_memory:
            # XLA's analysis, as the memory model that chose the plan is an estimate: the
            # step would fail at its first allocation, deep in the run
            have_gb = devices_memory_gb(list(self.mesh.devices.flat), default_gb=0.0)
            try:
                need_gb = compiled_bytes(compiled_step) / 2**30
            except Exception:  # noqa: BLE001 - a backend without the analysis
                need_gb = 0.0
            if have_gb and need_gb > have_gb:
                warnings.warn(OverMemoryWarning(
                    f"plan {self.plan.describe()}: the compiled step needs {need_gb:.3g} GiB "
                    f"a device (XLA's memory analysis), its devices have {have_gb:.3g} GiB; it "
                    f"will likely run out of memory (remat is {remat_name(self.train.remat)!r}:"
                    f" 'projections' or 'full' keep less, as do smaller micro-batches or more "
                    f"devices)"), stacklevel=1)
        return dataclasses.replace(self, step_fn=compiled_step)

    def _without_branches(self, hanging: list[BranchCollective]) -> StepProgram:
        what = "; ".join(sorted({"a " + c.describe() for c in hanging}))
        if self.selecting is None:
            raise PlanError(
                f"plan {self.plan.describe()}: the model's blocks hold {what} inside a "
                "pipeline branch that some devices never reach (the step would hang), and "
                "this program has no other gates. Move data across a tp-sharded axis "
                "outside the block, or train with tp=1")
        warnings.warn(SelectedGatesWarning(
            f"plan {self.plan.describe()}: the model's blocks hold {what} (data moved "
            "across a tp-sharded axis, e.g. jnp.split of a fused projection whose parts "
            "do not line up with the tp shards) which a pipeline branch would leave some "
            "devices out of: the step would hang. It runs its gates by selection instead "
            "(idle stages and micro-batches compute and drop their work: slower, same "
            "math). To keep the branches, cut the projection per head (reshape to "
            "[..., heads, 3 * head_dim] and split the last axis), or train with tp=1"),
            stacklevel=2)
        # what the builder's caller set on this program (its plan's current splits, its
        # initial parameters) carries over
        selected = dataclasses.replace(self.selecting(), plan=self.plan,
                                       initial_params=self.initial_params)
        state, batch, splits = abstract_args(selected)
        return selected.adopt_compiled(selected.step_fn.lower(state, batch, splits).compile())

    def canonical_params(self, state: TrainState) -> Any:
        """The state's parameters with the blocks in canonical order `[n_layers, ...]`,
        sharded over 'tp' alone (replicated over dp and pp, not spread: every process of a
        job holds all of its tp groups' shards, so `jax.device_get` can read them whole)."""
        params = self.to_canonical_fn(state, self.canonical_positions()).params
        target = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), self.param_specs,
                              is_leaf=lambda x: isinstance(x, P))
        return jax.jit(lambda p: p, out_shardings=target)(params)


def step_functions(loss_sum: Callable[[Any, Batch, Splits, jax.Array], jax.Array],
                   optimizer: optax.GradientTransformation, shardings: TrainState,
                   mesh: jax.sharding.Mesh, donate: bool) -> tuple[Callable, Callable]:
    """(train step, loss-and-gradients) jitted around `loss_sum(params, batch, splits, step)`
    (the batch's summed token losses): the loss is their token-weighted mean over the global
    batch, the same for every plan and every model."""
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P("dp"))

    def loss_and_grads(params: Any, batch: Batch, splits: Splits, step: Any = 0):
        count = jnp.maximum(token_count(batch.segment_ids), 1.0)
        step = jnp.asarray(step, jnp.int32)
        loss, grads = jax.value_and_grad(
            lambda p: loss_sum(p, batch, splits, step) / count)(params)
        return loss, grads, count

    def train_step(state: TrainState, batch: Batch, splits: Splits):
        loss, grads, count = loss_and_grads(state.params, batch, splits, state.step)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "tokens": count, "grad_norm": optax.tree.norm(grads)}
        return TrainState(state.step + 1, params, opt_state), metrics

    batch_shardings = Batch(batch_sharding, batch_sharding, batch_sharding)
    split_shardings = Splits(replicated, replicated, NamedSharding(mesh, KNOB_SPEC))
    step_fn = jax.jit(train_step, in_shardings=(shardings, batch_shardings, split_shardings),
                      out_shardings=(shardings, replicated), donate_argnums=0 if donate else ())
    grads_fn = jax.jit(lambda p, b, s: loss_and_grads(p, b, s)[:2],
                       in_shardings=(shardings.params, batch_shardings, split_shardings),
                       out_shardings=(replicated, shardings.params))
    return step_fn, grads_fn


def fresh_state(optimizer: optax.GradientTransformation, params: Any,
                index_PxL: Any) -> TrainState:
    """The state at step 0 of canonical `params`, in the stage layout of `index_PxL`."""
    staged = layout.to_stage_layout(params, index_PxL)
    return TrainState(jnp.zeros((), jnp.int32), staged, optimizer.init(staged))


def canonical_state_shapes(stage_shapes: TrainState, n_layers: int) -> TrainState:
    """Shapes of a state whose layer leaves are in canonical order `[n_layers, ...]`."""
    positions = jax.ShapeDtypeStruct((n_layers,), jnp.int32)
    return jax.eval_shape(layout.to_canonical_layout, stage_shapes, positions)


# cuBLAS matmuls leave a compiled GPU program as custom calls, not as `dot` instructions
_GEMM_CALL = re.compile(r'custom_call_target="__cublas')
_HLO_DOT = re.compile(r"\sdot\(")
_FUNC = re.compile(r"func\.func\s+(?:\w+\s+)*@([\w.$-]+)\(")


def matmul_count(lowered_or_compiled: Any) -> int:
    """Matrix multiplications a step's program writes down, each once where it is written
    (a loop body's once): a lowered program's `dot_general`s (a function's at each call), or
    a compiled one's `dot`s and cuBLAS calls. A backward that re-runs the forward shows up
    as extra matmuls."""
    text = lowered_or_compiled.as_text()
    if isinstance(lowered_or_compiled, jax.stages.Compiled):
        return len(_HLO_DOT.findall(text)) + len(_GEMM_CALL.findall(text))
    starts = [(m.start(), m.group(1)) for m in _FUNC.finditer(text)]
    bodies = {name: text[start:end] for (start, name), (end, _) in
              zip(starts, starts[1:] + [(len(text), "")])}

    @functools.cache
    def count(name: str) -> int:
        body = bodies[name]
        return body.count("stablehlo.dot_general") + sum(
            count(callee) for callee in re.findall(r"call @([\w.$-]+)\(", body)
            if callee in bodies)

    return count("main") if "main" in bodies else text.count("stablehlo.dot_general")


def placed_shapes(shapes: Any, shardings: Any) -> Any:
    """`shapes` as ShapeDtypeStructs carrying `shardings` (what `.lower` takes)."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)


def abstract_args(program: StepProgram) -> tuple[Any, Batch, Splits]:
    """(state, batch, splits) of `program.step_fn` as placed shapes."""
    plan, mesh = program.plan, program.mesh
    state = placed_shapes(program.state_shapes, program.state_shardings)
    rows = jax.ShapeDtypeStruct((plan.dp, program.mb_slots, plan.microbatch_size, plan.seq_len),
                                jnp.int32, sharding=program.batch_sharding)
    rep = program.replicated
    splits = Splits(jax.ShapeDtypeStruct((plan.pp,), jnp.int32, sharding=rep),
                    jax.ShapeDtypeStruct((plan.dp,), jnp.int32, sharding=rep),
                    jax.ShapeDtypeStruct((plan.dp, plan.pp, plan.tp), jnp.float32,
                                         sharding=NamedSharding(mesh, KNOB_SPEC)))
    return state, Batch(rows, rows, rows), splits
