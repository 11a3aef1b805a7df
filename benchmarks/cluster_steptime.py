"""Step-time check for `benchmarks/cluster.py`: the simulator's predictions against real runs.

Real train steps of the `tiny` model on 8 fake CPU devices (synthetic lognormal documents):
the cost model is fitted the way our detector fits it (`OnlineCostModel` on the step times of
healthy steps of the starting plan; per-stage times are not fitted, as the detector does
not fit them), then asked for the step time of each exact batch
under (a) the starting plan, (b) the plan our scheduler picks when a device is dead (a new
mesh the model never saw), (c) the starting plan with one device injected 3x slower
(`FaultInjector`, the sleep detection.py uses), (d) the re-plan again after its first 4
steps, with the drift scale the detector re-measures on them after every re-plan.
Error: mean predicted / mean measured - 1.
Must run in a process whose JAX sees 8 host devices (cluster.py sets XLA_FLAGS first).
"""

from __future__ import annotations

from typing import Any

import numpy as np

DEAD, SLOW, FACTOR = 5, 5, 3.0
ADAPT = 4  # steps observed on the new plan before the 'after' row


def _runner(plan: Any, cfg: Any, injector: Any, seed: int) -> Any:
    import jax

    from resihp_jax.step.instrument import chain_hosts
    from resihp_jax.runtime.trainer.timing import StageTimer
    from resihp_jax.step.config import StepConfig
    from resihp_jax.step.instrument import Instrument
    from resihp_jax.runtime.run.programs import preset_programs

    devices = [d for d in jax.devices() if d.id in plan.device_ids]
    devices = sorted(devices, key=lambda d: plan.device_ids.index(d.id))
    timer = StageTimer((plan.dp, plan.pp, plan.tp))
    _, programs = preset_programs(cfg, plan.seq_len, device=devices[0])
    program = programs(StepConfig(), plan, devices, Instrument(chain_hosts(injector, timer)))
    return program, timer, program.init_state(seed)


def timed_steps(plan: Any, cfg: Any, injector: Any, n: int, seed: int) -> list[Any]:
    """n timed steps (after 2 warm-up steps) as StepObservations."""
    from resihp_jax.data import BatchIterator
    from resihp_jax.detector import StepObservation
    from resihp_jax.detector.attention_work import mb_block_pair_l2
    from resihp_jax.runtime.trainer.records import device_batch
    from resihp_jax.runtime.trainer.timing import timed_step

    program, timer, state = _runner(plan, cfg, injector, seed)
    data = BatchIterator("synthetic:lognormal", n_microbatches=plan.n_microbatches,
                         microbatch_size=plan.microbatch_size, seq_len=plan.seq_len, seed=seed)
    out = []
    for step in range(n + 2):
        batch = data.next_batch()
        sharded = device_batch(program, batch)
        state, _, timing = timed_step(program, state, sharded, injector.knobs(step), timer)
        tokens = (batch.segment_ids_MxBxS > 0).sum(axis=(1, 2)).astype(np.float64)
        attn = mb_block_pair_l2(batch.segment_ids_MxBxS, cfg.attn_block)
        if step >= 2:
            out.append(StepObservation(step, plan, tokens, attn, timing.step_time_s,
                                       timing.stage_DxP))
    return out


def fit_as_detector(cfg: Any, observations: list[Any]) -> Any:
    """An OnlineCostModel fitted on these steps' step times, as the detector fits it
    (per-stage times left out)."""
    from resihp_jax.perfmodel import OnlineCostModel

    model = OnlineCostModel(cfg, window=max(128, len(observations)))
    for obs in observations:
        model.observe(obs.plan, obs.mb_tokens, obs.mb_sum_l2, obs.step_time_s)
    model.refit()
    return model


def step_time_check(fit_steps: int, test_steps: int, seed: int = 0) -> list[dict[str, Any]]:
    """Rows of (case, plan, measured ms, predicted ms, error)."""
    from resihp_jax.plan import Plan
    from resihp_jax.models.config import get_model_config
    from resihp_jax.perfmodel import Health
    from resihp_jax.faults.injector import FaultInjector
    from resihp_jax.scheduler.context import PlanningContext
    from resihp_jax.scheduler.resihp import resihp

    cfg = get_model_config("tiny")
    start = Plan.uniform(2, 2, 2, n_layers=cfg.n_layers, n_microbatches=4, microbatch_size=1,
                         seq_len=512)
    fit = timed_steps(start, cfg, FaultInjector(start), fit_steps + test_steps, seed)
    model = fit_as_detector(cfg, fit[:fit_steps])
    ctx = PlanningContext.for_plan(start, cfg, model.params, 80e9, pool=range(8))
    replan = resihp(start, Health(dead={DEAD}), ctx).plan
    slow = FaultInjector(start)
    slow.slow(SLOW, FACTOR, 0)
    replan_obs = timed_steps(replan, cfg, FaultInjector(replan), test_steps + ADAPT, seed + 1)
    cases = [("healthy", start, fit[fit_steps:], None),
             (f"re-plan, device {DEAD} dead (unseen mesh)", replan, replan_obs[ADAPT:], None),
             (f"device {SLOW} {FACTOR:g}x slow", start, timed_steps(start, cfg, slow, test_steps,
                                                               seed + 2),
              Health(compute={SLOW: 1.0 / FACTOR}))]
    rows = [_row(model, *case) for case in cases]
    # after a re-plan the detector re-measures its drift scale over its first steps on the new
    # plan (`ResiHPDetector.rebaseline`: the median of observed / predicted) and predicts
    # scale x the cost model from then on; so does this row
    scale = float(np.median([o.step_time_s / model.predict(replan, o.mb_tokens, o.mb_sum_l2)
                             for o in replan_obs[:ADAPT]]))
    rows.append(_row(model, f"re-plan, after {ADAPT} steps on it", replan, replan_obs[ADAPT:],
                     None, scale))
    return rows


def _row(model: Any, name: str, plan: Any, observed: list[Any], health: Any,
         scale: float = 1.0) -> dict[str, Any]:
    pred = [scale * model.predict(plan, o.mb_tokens, o.mb_sum_l2, health) for o in observed]
    meas = [o.step_time_s for o in observed]
    return {"case": name, "plan": plan.describe().split(" layers")[0],
            "measured_ms": round(1e3 * float(np.mean(meas)), 1),
            "predicted_ms": round(1e3 * float(np.mean(pred)), 1),
            "error": round(float(np.mean(pred) / np.mean(meas) - 1.0), 4)}
