"""Plan validation: every impossible plan gets one clear error naming the bad value."""

from __future__ import annotations

import jax
import pytest

from resihp_jax.errors import PlanError
from resihp_jax.meshes import layout
from resihp_jax.meshes.mesh import make_mesh
from resihp_jax.cli.args import parse_int_list, parse_mesh
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config

TINY = get_model_config("tiny")


def good(**changes) -> Plan:
    plan = Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=4, microbatch_size=2, seq_len=64)
    return plan.replace(**changes) if changes else plan


@pytest.mark.parametrize("changes, message", [
    ({"device_ids": (0, 1, 2, 3, 4, 5, 6)}, "dp\\*pp\\*tp"),
    ({"device_ids": (0, 1, 2, 3, 4, 5, 6, 6)}, "repeats device\\(s\\) \\[6\\]"),
    ({"device_ids": (0, 1, 2, 3, 4, 5, 6, -1)}, "must be >= 0"),
    ({"layers_per_stage": (4,)}, "pp=2 are needed"),
    ({"layers_per_stage": (0, 4)}, "at least one layer"),
    ({"microbatches_per_group": (4,)}, "dp=2 are needed"),
    ({"microbatches_per_group": (0, 4)}, "at least one micro-batch"),
    ({"dp": 0}, "Plan.dp=0"),
    ({"seq_len": 2.5}, "seq_len"),
    ({"layers_per_stage": ("a", 3)}, "layers_per_stage"),
])
def test_invalid_plans_are_rejected(changes: dict, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        good(**changes)


@pytest.mark.parametrize("plan, message", [
    (good(layers_per_stage=(2, 3)), "sums to 5; the model has 4"),
    (Plan.uniform(1, 1, 8, n_layers=4, n_microbatches=1, microbatch_size=1, seq_len=64),
     "tp=8 must divide"),
    (good(seq_len=60), "multiple of the attention block"),
])
def test_plans_impossible_for_the_model(plan: Plan, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan.check(TINY)


def test_plan_needs_available_devices() -> None:
    with pytest.raises(PlanError, match=r"device\(s\) \[7\] that are not available"):
        good().check(TINY, available_devices=range(7))
    with pytest.raises(PlanError, match=r"device id\(s\) \[7\]"):
        make_mesh(good(), jax.devices()[:7])


def test_mesh_places_devices_as_the_plan_says() -> None:
    plan = good(device_ids=(7, 3, 5, 1, 0, 2, 6, 4))
    mesh = make_mesh(plan, jax.devices())
    assert mesh.axis_names == ("dp", "pp", "tp")
    assert [[[d.id for d in row] for row in stage] for stage in mesh.devices] == \
        plan.device_grid().tolist()
    assert plan.coords_of(5) == (0, 1, 0)


def test_uniform_and_round_trip() -> None:
    plan = Plan.uniform(3, 2, 1, n_layers=5, n_microbatches=7, microbatch_size=2, seq_len=64)
    assert plan.layers_per_stage == (3, 2) and plan.microbatches_per_group == (3, 2, 2)
    assert Plan.from_dict(plan.to_dict()) == plan
    with pytest.raises(PlanError, match="unknown Plan field"):
        Plan.from_dict({**plan.to_dict(), "speed": 1})
    assert plan.same_mesh(plan.replace(layers_per_stage=(1, 4)))
    assert not plan.same_mesh(plan.replace(device_ids=(5, 4, 3, 2, 1, 0)))


def test_parsers() -> None:
    assert parse_mesh("dp=2,pp=2,tp=2") == {"dp": 2, "pp": 2, "tp": 2}
    assert parse_mesh("tp=4") == {"dp": 1, "pp": 1, "tp": 4}
    for bad in ("dp=2,dp=3", "xp=2", "dp=0", "dp=two"):
        with pytest.raises(PlanError):
            parse_mesh(bad)
    assert parse_int_list("1,3", "--layers") == (1, 3)
    with pytest.raises(PlanError, match="--layers"):
        parse_int_list("1,x", "--layers")


def test_layout_round_trip_and_slots() -> None:
    index_PxL = layout.stage_index((1, 3), 3)
    assert index_PxL.tolist() == [[0, -1, -1], [1, 2, 3]]
    assert layout.canonical_index(index_PxL).tolist() == [0, 3, 4, 5]
    assert layout.default_layer_slots(4, 2) == 3  # (1,3), (2,2), (3,1) share one program
    with pytest.raises(PlanError, match="layer slots"):
        layout.layer_slots_for(good(layers_per_stage=(1, 3)), requested=2)


def test_microbatches_of_a_hosts_devices_are_its_dp_groups() -> None:
    plan = Plan(3, 2, 1, (5, 0, 2, 7, 1, 4), (3, 1), (1, 2, 3), 2, 64)
    assert plan.microbatches_of([5]) == (0,)  # group 0: devices 5, 0
    assert plan.microbatches_of([0, 1]) == (0, 3, 4, 5)  # groups 0 and 2
    assert plan.microbatches_of([2, 7]) == (1, 2)
    assert plan.microbatches_of([3, 6]) == ()  # devices the plan leaves out
