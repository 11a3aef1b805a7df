"""The Plan: a frozen, validated value saying how one training step runs.

Every part of the system speaks Plans. `device_ids` lists the physical device at each
(dp, pp, tp) coordinate in row-major order, so placement is explicit and permutable.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence

import numpy as np

from resihp_jax.errors import PlanError

# The micro-batch slot of every DP group whose forward the train step times on each device.
# It lives here, below both step/ (which times it) and perfmodel/ (which predicts it).
TIMED_SLOT = 0


class PlannedModel(Protocol):
    """What `Plan.check` asks of a model: the part of perfmodel.facts.ModelFacts it needs
    (meshes sits below perfmodel, so it names the members rather than import the protocol)."""

    n_layers: int

    @property
    def seq_multiple(self) -> int: ...

    def tp_dims(self) -> tuple[int, ...]: ...


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise PlanError(f"Plan.{name}={value!r}: must be a positive integer")


def _int_tuple(name: str, values: object) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in values)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise PlanError(f"Plan.{name}={values!r}: must be a sequence of integers") from None
    if any(float(v) != o for v, o in zip(values, out)):  # type: ignore[arg-type]
        raise PlanError(f"Plan.{name}={values!r}: must be integers")
    return out


def even_split(total: int, parts: int) -> tuple[int, ...]:
    """`total` split into `parts` near-equal positive integers, larger parts first."""
    if parts < 1 or total < parts:
        raise PlanError(f"cannot split {total} into {parts} positive parts")
    base, extra = divmod(total, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


@dataclass(frozen=True)
class Plan:
    """How one step runs: dp x pp x tp over `device_ids`, the layer and micro-batch splits."""
    dp: int
    pp: int
    tp: int
    device_ids: tuple[int, ...]
    layers_per_stage: tuple[int, ...]
    microbatches_per_group: tuple[int, ...]
    microbatch_size: int
    seq_len: int

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "microbatch_size", "seq_len"):
            _positive_int(name, getattr(self, name))
        for name in ("device_ids", "layers_per_stage", "microbatches_per_group"):
            object.__setattr__(self, name, _int_tuple(name, getattr(self, name)))
        n = self.dp * self.pp * self.tp
        if len(self.device_ids) != n:
            raise PlanError(
                f"Plan.device_ids has {len(self.device_ids)} entries; dp*pp*tp = "
                f"{self.dp}*{self.pp}*{self.tp} = {n} are needed")
        if n and min(self.device_ids) < 0:
            raise PlanError(f"Plan.device_ids={self.device_ids}: ids must be >= 0")
        if len(set(self.device_ids)) != n:
            dupes = sorted(d for d, k in Counter(self.device_ids).items() if k > 1)
            raise PlanError(f"Plan.device_ids repeats device(s) {dupes}: each device holds one "
                            "mesh coordinate")
        for name, axis, needs in (
                ("layers_per_stage", "pp", "every stage needs at least one layer"),
                ("microbatches_per_group", "dp",
                 "every data-parallel group needs at least one micro-batch")):
            split, parts = getattr(self, name), getattr(self, axis)
            if len(split) != parts:
                raise PlanError(f"Plan.{name}={split} has {len(split)} entries; "
                                f"{axis}={parts} are needed")
            if min(split) < 1:
                raise PlanError(f"Plan.{name}={split}: {needs}")

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def uniform(cls, dp: int, pp: int, tp: int, *, n_layers: int, n_microbatches: int,
                microbatch_size: int, seq_len: int,
                device_ids: Sequence[int] | None = None) -> Plan:
        """Even layer and micro-batch splits; devices 0..n-1 in mesh order unless given."""
        for name, value in (("dp", dp), ("pp", pp), ("tp", tp)):
            _positive_int(name, value)
        if n_layers < pp:
            raise PlanError(f"n_layers={n_layers} < pp={pp}: every stage needs a layer")
        if n_microbatches < dp:
            raise PlanError(f"n_microbatches={n_microbatches} < dp={dp}: every data-parallel "
                            "group needs a micro-batch")
        ids = tuple(range(dp * pp * tp)) if device_ids is None else tuple(device_ids)
        return cls(dp, pp, tp, ids, even_split(n_layers, pp), even_split(n_microbatches, dp),
                   microbatch_size, seq_len)

    def replace(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)

    # ---- derived quantities --------------------------------------------------------------
    @property
    def n_devices(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def n_layers(self) -> int:
        return sum(self.layers_per_stage)

    @property
    def n_microbatches(self) -> int:
        return sum(self.microbatches_per_group)

    @property
    def global_rows(self) -> int:
        return self.n_microbatches * self.microbatch_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_rows * self.seq_len

    def device_grid(self) -> np.ndarray:
        """[dp, pp, tp] array of device ids."""
        return np.asarray(self.device_ids, dtype=np.int64).reshape(self.dp, self.pp, self.tp)

    def coords_of(self, device_id: int) -> tuple[int, int, int]:
        """(dp, pp, tp) coordinate of a device; PlanError if the plan does not use it."""
        if device_id not in self.device_ids:
            raise PlanError(f"device {device_id} is not in this plan's devices")
        flat = self.device_ids.index(device_id)
        return tuple(int(c) for c in np.unravel_index(flat, (self.dp, self.pp, self.tp)))

    def microbatch_offsets(self) -> tuple[int, ...]:
        """Index of each DP group's first micro-batch in the global batch."""
        return tuple(int(x) for x in np.cumsum((0,) + self.microbatches_per_group[:-1]))

    def microbatches_of(self, device_ids: Iterable[int]) -> tuple[int, ...]:
        """The global micro-batches routed to DP groups holding any of these devices: what
        a host with those devices reads of each batch."""
        ids = set(device_ids)
        offsets, grid = self.microbatch_offsets(), self.device_grid()
        return tuple(m for g in range(self.dp) if ids & set(grid[g].ravel().tolist())
                     for m in range(offsets[g], offsets[g] + self.microbatches_per_group[g]))

    def mesh_key(self) -> tuple[Any, ...]:
        """What a compiled step depends on: mesh shape, placement and row shape (not splits)."""
        return (self.dp, self.pp, self.tp, self.device_ids, self.microbatch_size, self.seq_len)

    def same_mesh(self, other: Plan) -> bool:
        """True when only the layer or micro-batch split differs (no recompilation needed)."""
        return self.mesh_key() == other.mesh_key()

    # ---- validation against a model and a device pool -----------------------------------
    def check(self, model: PlannedModel, available_devices: Sequence[int] | None = None
              ) -> Plan:
        """Raise PlanError if this plan cannot run `model` (any perfmodel.facts.ModelFacts)
        on `available_devices`."""
        if self.n_layers != model.n_layers:
            raise PlanError(f"Plan.layers_per_stage={self.layers_per_stage} sums to "
                            f"{self.n_layers}; the model has {model.n_layers} layers")
        dims = tuple(model.tp_dims())
        if any(d % self.tp for d in dims):
            raise PlanError(f"Plan.tp={self.tp} must divide the model's tensor-parallel "
                            f"dimensions {dims}")
        if self.seq_len % model.seq_multiple:
            raise PlanError(f"Plan.seq_len={self.seq_len} must be a multiple of the attention "
                            f"block size {model.seq_multiple} (the model's seq_multiple)")
        if available_devices is not None:
            missing = sorted(set(self.device_ids) - set(int(d) for d in available_devices))
            if missing:
                raise PlanError(f"Plan uses device(s) {missing} that are not available "
                                f"(available: {sorted(available_devices)})")
        return self

    # ---- text and JSON forms ------------------------------------------------------------
    def describe(self) -> str:
        return (f"dp={self.dp},pp={self.pp},tp={self.tp} "
                f"layers={','.join(map(str, self.layers_per_stage))} "
                f"microbatches={','.join(map(str, self.microbatches_per_group))}")

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v)
                for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise PlanError(f"unknown Plan field(s) {sorted(unknown)}; valid: {sorted(fields)}")
        missing = fields - set(data)
        if missing:
            raise PlanError(f"Plan is missing field(s) {sorted(missing)}")
        return cls(**data)
