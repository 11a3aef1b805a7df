"""`remat="auto"`: the least recomputing policy whose plan fits the devices' memory."""

from __future__ import annotations

import pytest

from resihp_jax.errors import PlanError
from resihp_jax.plan import Plan
from resihp_jax.models.config import get_model_config
from resihp_jax.perfmodel.costs import REMAT_POLICIES
from resihp_jax.perfmodel.memory import (devices_memory_gb, memory_bytes_per_device,
                                         remat_for_memory)
from resihp_jax.runtime.run.auto_plan import auto_plan, auto_plan_and_remat

MODEL = get_model_config("llama-1b")
PLAN = Plan.uniform(1, 1, 1, n_layers=MODEL.n_layers, n_microbatches=1, microbatch_size=16,
                    seq_len=2048)  # 32,768 tokens a step


def _need_gb(policy: str) -> float:
    return float(memory_bytes_per_device(PLAN, MODEL, remat=policy).max()) / 2**30


@pytest.mark.parametrize("policy", REMAT_POLICIES)
def test_the_least_recomputing_policy_that_fits_is_chosen(policy: str) -> None:
    chosen, why = remat_for_memory(MODEL, PLAN, _need_gb(policy) + 0.01)
    assert chosen == policy and "GiB" in why


def test_memory_too_small_for_any_policy_asks_for_full_and_says_so() -> None:
    chosen, why = remat_for_memory(MODEL, PLAN, _need_gb("full") / 2)
    assert chosen == "full" and "no policy fits" in why


def test_plan_auto_takes_the_policy_under_which_some_plan_fits() -> None:
    ids = list(range(8))
    roomy, policy = auto_plan_and_remat(MODEL, ids, 16, 2048, device_memory_gb=1000.0)
    assert policy == "none"
    # every plan of 8 devices needs more than the least "none" plan's bytes here: only a
    # recomputing policy fits
    least_none = min(float(memory_bytes_per_device(p, MODEL, remat="none").max())
                     for p in _candidate_plans(ids))
    tight, policy = auto_plan_and_remat(MODEL, ids, 16, 2048,
                                        device_memory_gb=least_none / 2**30 * 0.8)
    assert policy in ("projections", "full")
    assert float(memory_bytes_per_device(tight, MODEL, remat=policy).max()) <= least_none * 0.8
    for lesser in REMAT_POLICIES[:REMAT_POLICIES.index(policy)]:  # none of these has a plan
        with pytest.raises(PlanError):
            auto_plan(MODEL, ids, 16, 2048, device_memory_gb=least_none / 2**30 * 0.8,
                      remat=lesser)
    with pytest.raises(PlanError, match="fits"):
        auto_plan_and_remat(MODEL, ids, 16, 2048, device_memory_gb=0.01)


def _candidate_plans(ids: list[int]) -> list[Plan]:
    """Every uniform plan of the 8 devices with 16 rows of 2048 (the search's shapes)."""
    out = []
    for dp, pp, tp in [(a, b, c) for a in (1, 2, 4, 8) for b in (1, 2, 4, 8) for c in (1, 2, 4, 8)
                       if a * b * c == len(ids)]:
        for size in (1, 2, 4, 8, 16):
            if (16 // size) % dp == 0 and MODEL.n_layers >= pp:
                out.append(Plan.uniform(dp, pp, tp, n_layers=MODEL.n_layers,
                                        n_microbatches=16 // size, microbatch_size=size,
                                        seq_len=2048))
    return out


class _Device:
    def __init__(self, stats: dict | None) -> None:
        self.stats = stats

    def memory_stats(self) -> dict | None:
        if self.stats == "raise":
            raise RuntimeError("no statistics on this backend")
        return self.stats


def test_the_devices_own_memory_is_planned_with_and_cpus_get_the_default() -> None:
    gpus = [_Device({"bytes_limit": 80 * 2**30}), _Device({"bytes_limit": 70 * 2**30})]
    assert devices_memory_gb(gpus) == 70.0  # the least of them
    assert devices_memory_gb([_Device(None), _Device("raise")], default_gb=4.0) == 4.0


def test_a_bad_remat_is_refused_by_fit_naming_every_valid_one() -> None:
    import optax  # noqa: PLC0415

    import resihp_jax as rh  # noqa: PLC0415
    from resihp_jax.errors import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError, match=r"remat='some': valid are 'auto' .*'projections'"):
        rh.fit(None, [], optimizer=optax.sgd(0.1), plan="auto", steps=1, remat="some")
