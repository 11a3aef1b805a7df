"""Linear features of a simulated step: for a fixed critical path, the step time is
`units @ (c, alpha, beta, head_alpha, tick_overhead, step_overhead)`, which is what lets
`online.py` learn the coefficients by least squares. Healthy devices and free communication are
assumed (the fitted coefficients fold communication in).
"""

from __future__ import annotations

import numpy as np

from resihp_jax.plan import TIMED_SLOT, Plan
from resihp_jax.perfmodel.simulator import StepSim
from resihp_jax.perfmodel.costs import recomputes_forward
from resihp_jax.perfmodel.work import GroupData

PATH_FEATURES = ("c", "alpha", "beta", "head_alpha", "tick_overhead", "step_overhead")


def path_units(sim: StepSim, plan: Plan, tokens_N: np.ndarray, sum_l2_N: np.ndarray,
               bwd_ratio: float, remat: bool, schedule: str) -> np.ndarray:
    """[6] coefficient multipliers summed along the simulated critical path."""
    work = [n for n in sim.critical_path if n[0] in ("F", "B")]
    units = np.zeros(len(PATH_FEATURES))
    units[5] = 1.0
    if not work:
        return units
    kind_K = np.array([n[0] == "B" for n in work])
    stage_K = np.array([n[2] for n in work])
    mb_K = np.array([n[3] for n in work])
    valid_K = mb_K >= 0
    safe_K = np.where(valid_K, mb_K, 0)
    bwd = bwd_ratio + (1.0 if recomputes_forward(remat) else 0.0)  # a recomputed forward
    mult_K = np.where(kind_K, bwd, 1.0) * valid_K / plan.tp
    layers_K = np.asarray(plan.layers_per_stage, dtype=np.float64)[stage_K]
    tok_K, l2_K = tokens_N[safe_K], sum_l2_N[safe_K]
    units[0] = np.sum(mult_K * layers_K)
    units[1] = np.sum(mult_K * layers_K * tok_K)
    units[2] = np.sum(mult_K * layers_K * l2_K)
    units[3] = np.sum(mult_K * tok_K * (stage_K == plan.pp - 1))
    units[4] = len(work) if schedule == "gpipe" else float(valid_K.sum())
    return units


def stage_units(plan: Plan, data: GroupData) -> np.ndarray:
    """[dp * pp, 6] multipliers of each stage's timed forward (StepSim.timed_fwd_s,
    flattened): slot TIMED_SLOT of each group through the stage's layers."""
    layers_S = np.asarray(plan.layers_per_stage, dtype=np.float64)
    timed_Gx3 = np.stack([data.valid_GxM[:, TIMED_SLOT], data.tokens_GxM[:, TIMED_SLOT],
                          data.sum_l2_GxM[:, TIMED_SLOT]], axis=1)
    units = np.zeros((plan.dp, plan.pp, len(PATH_FEATURES)))
    units[:, :, :3] = layers_S[None, :, None] * timed_Gx3[:, None, :] / plan.tp
    return units.reshape(plan.dp * plan.pp, len(PATH_FEATURES))


def total_units(plan: Plan, tokens_N: np.ndarray, sum_l2_N: np.ndarray) -> np.ndarray:
    """[3] work summed over every device: what a host that runs all devices on shared cores
    (fake CPU devices) pays, on top of the pipeline's critical path."""
    layers = float(plan.n_layers)
    return np.array([layers * len(tokens_N), layers * tokens_N.sum(), layers * sum_l2_N.sum()])
