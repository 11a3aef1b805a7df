"""Robust non-negative least squares on relative errors (what MAPE measures).

Columns that the data cannot tell apart from earlier (higher-priority) columns are dropped,
negative coefficients are dropped one at a time, and iteratively reweighted least squares
with Huber weights (plus rejection of gross outliers) keeps slow steps from skewing the fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HUBER_K = 1.345
REJECT_K = 6.0  # residuals beyond this many robust sigmas get weight 0
MIN_SCALE = 1e-4  # relative-residual floor so exact (noise-free) data stays well-posed


@dataclass(frozen=True)
class RobustFit:
    coef: np.ndarray  # [F] (0 for dropped columns)
    active: np.ndarray  # [F] bool
    scale: float  # robust sigma of the relative residuals
    weights: np.ndarray  # [N] final IRLS weights


def identifiable(a_NxF: np.ndarray, tol: float = 1e-2) -> np.ndarray:
    """Columns, in priority order, that add a direction the earlier kept columns lack."""
    norms = np.linalg.norm(a_NxF, axis=0)
    keep = np.zeros(a_NxF.shape[1], dtype=bool)
    basis = np.zeros((a_NxF.shape[0], 0))
    for j in range(a_NxF.shape[1]):
        if norms[j] == 0.0:
            continue
        col = a_NxF[:, j] / norms[j]
        resid = col - basis @ (basis.T @ col)
        if np.linalg.norm(resid) > tol:
            keep[j] = True
            basis = np.column_stack([basis, resid / np.linalg.norm(resid)])
    return keep


def _nn_lstsq(a_NxF: np.ndarray, b_N: np.ndarray, w_N: np.ndarray, active: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """Weighted least squares, dropping the most negative coefficient until none is."""
    active = active.copy()
    sw = np.sqrt(w_N)[:, None]
    while True:
        coef = np.zeros(a_NxF.shape[1])
        if active.any():
            coef[active] = np.linalg.lstsq(sw * a_NxF[:, active], sw[:, 0] * b_N, rcond=None)[0]
        if coef.min(initial=0.0) >= 0.0:
            return coef, active
        active[np.argmin(coef)] = False


def robust_relative_fit(x_NxF: np.ndarray, y_N: np.ndarray, iters: int = 30) -> RobustFit:
    """Minimize a robust loss of (y - x @ coef) / y over coef >= 0."""
    a = x_NxF / y_N[:, None]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0.0] = 1.0
    a_scaled, b = a / norms, np.ones(len(y_N))
    candidates = identifiable(a_scaled)
    w = np.ones(len(y_N))
    coef, scale = np.zeros(a.shape[1]), MIN_SCALE
    for _ in range(iters):
        coef_new, active = _nn_lstsq(a_scaled, b, w, candidates)
        r = b - a_scaled @ coef_new
        scale = max(1.4826 * float(np.median(np.abs(r))), MIN_SCALE)
        w = np.minimum(1.0, HUBER_K * scale / np.maximum(np.abs(r), 1e-300))
        w[np.abs(r) > REJECT_K * scale] = 0.0
        done = np.allclose(coef_new, coef, rtol=1e-7, atol=1e-12)
        coef = coef_new
        if done:
            break
    return RobustFit(coef / norms, active, scale, w)
