"""remat="auto" per plan: the memory model's pick, stepped up while the compiled step's
bytes do not fit (runtime/programs/remat_choice.py), with the compile injected."""

from __future__ import annotations

import pytest

from resihp_jax.perfmodel.costs import REMAT_POLICIES
from resihp_jax.runtime.programs.remat_choice import within_memory

GIB = 2**30


def _choose(need_gib: dict[str, float], first: str, limit_gib: float | None
            ) -> tuple[str, str, list[tuple[str, bool]]]:
    """(policy, why, builds): `within_memory` over a step whose compiled bytes per policy are
    `need_gib`; builds lists each (policy, last) it asked to be compiled."""
    builds: list[tuple[str, bool]] = []

    def build(policy: str, last: bool) -> str:
        builds.append((policy, last))
        return policy  # the "program" is its policy: its bytes are looked up below

    program, policy, why = within_memory(
        build, (first, "the model's reason"), None if limit_gib is None else limit_gib * GIB,
        lambda program: need_gib[program] * GIB)
    assert program == policy
    return policy, why, builds


NEEDS = {"none": 90.0, "projections": 70.0, "full": 40.0}


@pytest.mark.parametrize("limit, chosen", [(95.0, "none"), (80.0, "projections"),
                                           (50.0, "full")])
def test_the_least_recomputing_policy_whose_compiled_step_fits_is_taken(limit: float,
                                                                        chosen: str) -> None:
    policy, why, builds = _choose(NEEDS, "none", limit)
    assert policy == chosen
    tried = REMAT_POLICIES[:REMAT_POLICIES.index(chosen) + 1]
    assert [p for p, _ in builds] == list(tried)  # one compile each, none after the fit
    assert f"{NEEDS[chosen]:g} of {limit:g} GiB" in why
    for over in tried[:-1]:  # each step-up names what the policy before asked for
        assert f"{over} needs {NEEDS[over]:g} GiB" in why


def test_the_memory_models_pick_is_the_first_tried() -> None:
    policy, _, builds = _choose(NEEDS, "projections", 95.0)
    assert policy == "projections" and builds == [("projections", False)]


def test_only_the_last_policy_may_warn_and_full_stands_when_nothing_fits() -> None:
    policy, why, builds = _choose(NEEDS, "none", 10.0)
    assert policy == "full"
    assert builds == [("none", False), ("projections", False), ("full", True)]
    assert "no policy's compiled step fits 10 GiB" in why and "full needs 40 GiB" in why


def test_without_a_known_memory_the_first_pick_stands_compiled_once() -> None:
    policy, why, builds = _choose(NEEDS, "none", None)
    assert (policy, builds) == ("none", [("none", True)])
    assert "the model's reason" in why and "report no memory" in why


def test_the_trainer_compiles_the_policy_whose_step_fits_the_given_memory() -> None:
    """A trainer with remat="auto" and a device memory just under what the step asks for
    with nothing recomputed: the memory model's pick (none) is stepped up to the first
    policy whose compiled step, measured here the same way, fits (XLA:CPU keeps nearly as
    much under every policy, but a little less under projections)."""
    import jax  # noqa: PLC0415

    from resihp_jax.data import BatchIterator  # noqa: PLC0415
    from resihp_jax.plan import Plan  # noqa: PLC0415
    from resihp_jax.models.config import get_model_config  # noqa: PLC0415
    from resihp_jax.perfmodel.memory import (compiled_bytes,  # noqa: PLC0415
                                             memory_bytes_per_device)
    from resihp_jax.runtime.programs.deferred import compile_step  # noqa: PLC0415
    from resihp_jax.runtime.run.programs import preset_programs  # noqa: PLC0415
    from resihp_jax.runtime.trainer.resilient import ResilientTrainer
    from resihp_jax.runtime.config import ResilienceConfig
    from resihp_jax.step.config import StepConfig  # noqa: PLC0415

    model = get_model_config("tiny").replace(vocab_size=256)
    devices = jax.devices()[:1]
    plan = Plan.uniform(1, 1, 1, n_layers=model.n_layers, n_microbatches=1, microbatch_size=1,
                        seq_len=128, device_ids=(int(devices[0].id),))
    train = StepConfig(remat="auto", loss_chunks=1, microbatch_slots=1)

    _, programs = preset_programs(model, plan.seq_len)

    def need(policy: str) -> int:  # what XLA says the step asks for under `policy`
        return compiled_bytes(compile_step(programs(
            train.replace(remat=policy), plan, devices)).step_fn)

    none, projections = need("none"), need("projections")
    if projections < none:  # just under none's: projections fits
        limit, expected = (none + projections) / 2, "projections"
    else:  # just under none's, which the others may not undercut: full, fitting or not
        limit, expected = none * 0.999, "full"
    assert float(memory_bytes_per_device(plan, model, remat="none").max()) <= limit  # none first
    data = BatchIterator("synthetic:lognormal", n_microbatches=1, microbatch_size=1,
                         seq_len=128, seed=0)
    trainer = ResilientTrainer(model, train, plan, devices, data, ResilienceConfig(
        device_memory_gb=limit / GIB, precompile=0, compile_cache_dir=None),
        programs=programs)
    try:
        assert trainer.program.train.remat == expected
        policy, why = trainer.remat_chosen[plan.mesh_key()]
        assert policy == expected and f"none needs {none / GIB:.3g} GiB" in why
    finally:
        trainer.close()


def test_a_step_built_directly_refuses_auto_by_name() -> None:
    import jax  # noqa: PLC0415

    from resihp_jax.errors import ConfigError  # noqa: PLC0415
    from resihp_jax.plan import Plan  # noqa: PLC0415
    from resihp_jax.models.config import get_model_config  # noqa: PLC0415
    from resihp_jax.runtime.programs.deferred import compile_step  # noqa: PLC0415
    from resihp_jax.step.config import StepConfig  # noqa: PLC0415
    from tests.helpers import llama_step  # noqa: PLC0415

    model = get_model_config("tiny")
    plan = Plan.uniform(1, 1, 1, n_layers=model.n_layers, n_microbatches=1, microbatch_size=1,
                        seq_len=32, device_ids=(int(jax.devices()[0].id),))
    with pytest.raises(ConfigError, match="remat='auto' is chosen per plan by the trainer"):
        compile_step(llama_step(model, StepConfig(remat="auto"), plan, jax.devices()[:1]))
