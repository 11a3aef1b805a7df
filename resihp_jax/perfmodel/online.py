"""OnlineCostModel: learns CostParams from observed healthy steps, starting from nothing.

For a fixed critical path the simulated step time is linear in the coefficients, so a refit
simulates each observation of a sliding window under the current estimate for its path's
features, solves a robust relative least squares, and repeats until the estimate settles. A
'contention' model adds work summed over all devices (what many fake devices on few cores
pay); mode 'auto' uses it only when it fits much better.
"""

from __future__ import annotations

import copy
import math
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan
from resihp_jax.models.config import ModelConfig
from resihp_jax.perfmodel import features
from resihp_jax.perfmodel.costs import CostParams
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.perfmodel.health import Health
from resihp_jax.perfmodel.robust import RobustFit, robust_relative_fit
from resihp_jax.perfmodel.simulator import StepSim, check_schedule, simulate_step
from resihp_jax.perfmodel.work import group_data

MODES = ("auto", "pipeline", "contention")
N_PATH = len(features.PATH_FEATURES)
# critical paths are re-derived when the estimate moves predictions by more than this
PATH_RECHECK = 2e-3
# a refit that moves the predictions less than this (median relative change) finds the model
# settled: the next one may wait longer (`max_refit_every`)
STABLE_MOVE = 0.01
PREDICTIONS_KEPT = 8  # predictions remembered per fit (see OnlineCostModel.predict)


@dataclass(frozen=True)
class _Refit:
    """What one refit found: applied at once, or `refit_lag` steps after it started."""
    theta: np.ndarray
    version: int
    fit: RobustFit
    uses_contention: bool
    refit_gap: int


@dataclass
class _Obs:
    plan: Plan
    tokens_N: np.ndarray
    sum_l2_N: np.ndarray
    mb_slots: int | None
    step_time_s: float
    total_x: np.ndarray
    path_x: np.ndarray = field(default_factory=lambda: np.zeros(N_PATH))
    path_version: int = -1


class OnlineCostModel:
    def __init__(self, model: ModelFacts | None = None, *, schedule: str = "gpipe",
                 remat: bool = False, bwd_ratio: float = 2.0, window: int = 256,
                 min_steps: int = 8, refit_every: int = 4, mode: str = "auto",
                 max_refit_every: int | None = None, refit_lag: int = 0) -> None:
        """`max_refit_every`: a refit leaving the predictions within STABLE_MOVE doubles the
        steps to the next, up to this many (None: always `refit_every`): re-simulating the
        window is most of the detector's host time on the step loop's path once settled.
        `refit_lag` > 0: after the first fit, a refit runs in a background thread on the
        window as it was and takes effect `refit_lag` observations later (waited for then):
        off the step loop's path (a 40 ms refit on a step of 46 ms). Both deterministic, so
        every process of a job refits alike."""
        check_schedule(schedule)
        if mode not in MODES:
            raise ConfigError(f"OnlineCostModel mode={mode!r}: valid are {', '.join(MODES)}")
        if not (window >= min_steps >= 2 and refit_every >= 1):
            raise ConfigError(f"OnlineCostModel: need window={window} >= min_steps={min_steps} "
                              f">= 2 and refit_every={refit_every} >= 1")
        if isinstance(refit_lag, bool) or not isinstance(refit_lag, int) or refit_lag < 0:
            raise ConfigError(f"OnlineCostModel refit_lag={refit_lag!r}: must be an integer "
                              ">= 0 (0: refit on the spot)")
        if not (math.isfinite(bwd_ratio) and bwd_ratio > 0):
            raise ConfigError(f"OnlineCostModel bwd_ratio={bwd_ratio!r}: must be > 0")
        self.model, self.schedule, self.remat, self.bwd_ratio = model, schedule, remat, bwd_ratio
        self.mode, self.min_steps, self.refit_every = mode, min_steps, refit_every
        self.max_refit_every = max(refit_every, max_refit_every or refit_every)
        self._refit_gap = refit_every  # steps between refits now
        self._obs: deque[_Obs] = deque(maxlen=window)
        self._since_fit = 0
        self._version = 0
        self._theta: np.ndarray | None = None  # pipeline-only coefficients [6]
        self._fit: RobustFit | None = None  # the model used for predictions
        self.uses_contention = False
        # the newest predictions of this fit: a step's deadline and its judgement after it
        # ask for the same batch (one pipeline simulation, not two, on the step loop's path)
        self._predicted: dict[tuple, float] = {}
        self.refit_lag = refit_lag
        self._seen = 0  # observations so far (when a background refit takes effect)
        # a refit under way: (its thread, where it puts its result, the observation at which
        # it takes effect)
        self._pending: tuple[threading.Thread | None, dict[str, Any], int] | None = None

    @property
    def ready(self) -> bool:
        return self._fit is not None and len(self._obs) >= self.min_steps

    @property
    def params(self) -> CostParams:
        """The pipeline-model coefficients (communication folded into them)."""
        self._require_fit()
        return self._costs(self._theta)  # type: ignore[arg-type]

    @property
    def noise(self) -> float:
        """Robust sigma of the relative prediction error on the window, corrected for the
        degrees of freedom the fit used (residuals of p coefficients fitted on n rows are
        smaller than the errors on new steps; early on, with n near p, by a lot)."""
        self._require_fit()
        fit = self._fit
        n, p = len(fit.weights), int(fit.active.sum())  # type: ignore[union-attr]
        return fit.scale * math.sqrt(n / max(n - p, 1))  # type: ignore[union-attr]

    def observe(self, plan: Plan, mb_tokens: np.ndarray | None, mb_sum_l2: np.ndarray | None,
                step_time_s: float, *, mb_slots: int | None = None) -> None:
        """Record one healthy step; refits every `refit_every` steps once `min_steps` seen."""
        try:
            step_s = float(step_time_s)
        except (TypeError, ValueError):
            step_s = math.nan
        if not (math.isfinite(step_s) and step_s > 0):
            raise ConfigError(f"step_time_s={step_time_s!r}: must be a finite time > 0")
        tok_N, l2_N = _global(plan, mb_tokens, mb_sum_l2, mb_slots)
        self._obs.append(_Obs(plan, tok_N, l2_N, mb_slots, step_s,
                              features.total_units(plan, tok_N, l2_N)))
        self._since_fit += 1
        self._seen += 1
        if self._pending is not None and self._seen >= self._pending[2]:
            self._take_pending()
        if self._pending is None and len(self._obs) >= self.min_steps and (
                self._fit is None or self._since_fit >= self._refit_gap):
            if self._fit is None or not self.refit_lag:
                self.refit()
            else:
                self._refit_later()

    def predict(self, plan: Plan, mb_tokens: np.ndarray | None, mb_sum_l2: np.ndarray | None,
                health: Health | None = None, *, mb_slots: int | None = None) -> float:
        """Predicted step time of this exact batch under this plan (and health)."""
        self._require_fit()
        if health is not None:
            return self._predict(plan, mb_tokens, mb_sum_l2, health, mb_slots)
        key = (plan, _key(mb_tokens), _key(mb_sum_l2), mb_slots)
        if key not in self._predicted:
            if len(self._predicted) >= PREDICTIONS_KEPT:
                self._predicted.pop(next(iter(self._predicted)))
            self._predicted[key] = self._predict(plan, mb_tokens, mb_sum_l2, None, mb_slots)
        return self._predicted[key]

    def _predict(self, plan: Plan, mb_tokens: np.ndarray | None, mb_sum_l2: np.ndarray | None,
                 health: Health | None, mb_slots: int | None) -> float:
        coef = self._fit.coef  # type: ignore[union-attr]
        costs = self._costs(coef[:N_PATH])
        step_s = self._simulate(plan, costs, mb_tokens, mb_sum_l2, mb_slots, health).step_time_s
        if not self.uses_contention:
            return step_s
        tok_N, l2_N = _global(plan, mb_tokens, mb_sum_l2, mb_slots)
        shared_s = float(features.total_units(plan, tok_N, l2_N) @ coef[N_PATH:])
        if health is None:
            return step_s + shared_s
        # Shared cores stretch each device's work, a slow device's too: one f times slower
        # takes f times its *contended* time (what the fault injector's sleep adds). So the
        # contention share grows as the path's device work does; only the per-step cost is
        # outside every device's work.
        fixed_s = float(coef[N_PATH - 1])  # step_overhead
        work_s = self._simulate(plan, costs, tok_N, l2_N, mb_slots).step_time_s - fixed_s
        return step_s + shared_s * ((step_s - fixed_s) / work_s if work_s > 0 else 1.0)

    def _simulate(self, plan: Plan, costs: CostParams, tokens: np.ndarray | None,
                  sum_l2: np.ndarray | None, mb_slots: int | None,
                  health: Health | None = None, trace: bool = False) -> StepSim:
        return simulate_step(plan, self._model_for(plan), costs,
                             mb_tokens=tokens, mb_sum_l2=sum_l2, health=health,
                             schedule=self.schedule, remat=self.remat, mb_slots=mb_slots,
                             trace=trace)

    def refit(self) -> None:
        """Re-estimate from the window now (a background refit under way ends first)."""
        if self._pending is not None:
            self._take_pending()
        self._since_fit = 0
        self._predicted.clear()
        if self._obs:
            self._apply(self._computed_refit(list(self._obs)))

    def _refit_later(self) -> None:
        """Start a refit of the window as it is now, taking effect `refit_lag` steps on."""
        self._since_fit = 0
        window, box = list(self._obs), {}

        def work() -> None:
            try:
                box["refit"] = self._computed_refit(window)
            except BaseException as err:  # noqa: BLE001 - raised where it takes effect
                box["error"] = err

        thread = threading.Thread(target=work, name="cost-model-refit", daemon=True)
        self._pending = (thread, box, self._seen + self.refit_lag)
        thread.start()

    def __deepcopy__(self, memo: dict) -> OnlineCostModel:
        """A copy (a thread cannot be copied): a refit under way is waited for, and the copy
        takes its result at the same observation as this model does."""
        if self._pending is not None and self._pending[0] is not None:
            self._pending[0].join()  # first: the refit reads (and caches in) this model
        out = type(self).__new__(type(self))
        memo[id(self)] = out
        for name, value in self.__dict__.items():
            if name == "_pending" and value is not None:
                value = (None, value[1], value[2])
            setattr(out, name, copy.deepcopy(value, memo))
        return out

    def _take_pending(self) -> None:
        thread, box, _ = self._pending  # type: ignore[misc]
        if thread is not None:  # (a copy's: finished before it was copied)
            thread.join()
        self._pending = None
        if "error" in box:
            raise box["error"]
        self._apply(box["refit"])

    def _apply(self, refit: _Refit) -> None:
        self._theta, self._version, self._fit = refit.theta, refit.version, refit.fit
        self.uses_contention, self._refit_gap = refit.uses_contention, refit.refit_gap
        self._predicted.clear()  # (a prediction made meanwhile used the old fit)

    def _computed_refit(self, window: list[_Obs]) -> _Refit:
        """Re-estimate from `window`: alternate critical paths and robust least squares.
        Reads the model's fit, writes only the window's cached paths (any thread; one at a
        time)."""
        theta, version, gap = self._theta, self._version, self._refit_gap
        first = theta is None
        if first:
            theta = self._initial_theta(window)
        for attempt in range(6):
            self._update_paths(window, theta, version)
            x_path, y = _design(window, with_total=False)
            pipe = robust_relative_fit(x_path, y)
            moved = _relative_move(x_path, y, theta, pipe.coef)
            if attempt == 0:  # how far this refit moved the predictions
                settled = not first and moved < STABLE_MOVE
                gap = min(2 * gap, self.max_refit_every) if settled else self.refit_every
            theta = pipe.coef if pipe.coef.any() else theta
            if moved < PATH_RECHECK:
                break
            version += 1
        fit, uses_contention = self._chosen_model(pipe, window)
        return _Refit(theta, version, fit, uses_contention, gap)

    def _chosen_model(self, pipe: RobustFit, window: list[_Obs]) -> tuple[RobustFit, bool]:
        if self.mode == "pipeline":
            return pipe, False
        x_all, y = _design(window, with_total=True)
        both = robust_relative_fit(x_all, y)
        if self.mode == "contention" or both.scale < 0.7 * pipe.scale:
            return both, True
        return RobustFit(np.concatenate([pipe.coef, np.zeros(3)]),
                         np.concatenate([pipe.active, np.zeros(3, dtype=bool)]),
                         pipe.scale, pipe.weights), False

    def _require_fit(self) -> None:
        if self._fit is None or self._theta is None:
            raise ConfigError(f"OnlineCostModel has no fit yet: it needs {self.min_steps} "
                              f"observed steps (has {len(self._obs)}); check .ready first")

    def _costs(self, theta: np.ndarray) -> CostParams:
        c, alpha, beta, head, tick, step = (float(v) for v in theta)
        return CostParams(c=c, alpha=alpha, beta=beta, bwd_ratio=self.bwd_ratio,
                          head_alpha=head, tick_overhead=tick, step_overhead=step)

    def _model_for(self, plan: Plan) -> ModelFacts:
        if self.model is not None and self.model.n_layers == plan.n_layers:
            return self.model
        return ModelConfig(n_layers=plan.n_layers)  # communication is folded: sizes unused

    @staticmethod
    def _initial_theta(window: list[_Obs]) -> np.ndarray:
        """Equal share for the fixed, per-token and attention terms: just to pick paths."""
        tok = np.mean([o.tokens_N.mean() for o in window])
        l2 = np.mean([o.sum_l2_N.mean() for o in window])
        return np.array([1.0, 1.0 / max(tok, 1.0), 1.0 / max(l2, 1.0), 0.0, 0.0, 0.0])

    def _update_paths(self, window: list[_Obs], theta: np.ndarray, version: int) -> None:
        costs = self._costs(theta)
        for obs in window:
            if obs.path_version == version:
                continue
            sim = self._simulate(obs.plan, costs, obs.tokens_N, obs.sum_l2_N, obs.mb_slots,
                                 trace=True)
            obs.path_x = features.path_units(sim, obs.plan, obs.tokens_N, obs.sum_l2_N,
                                             self.bwd_ratio, self.remat, self.schedule)
            obs.path_version = version


def _key(values: np.ndarray | None) -> tuple | None:
    """A hashable form of a per-micro-batch array (None stays None)."""
    if values is None:
        return None
    array = np.asarray(values)
    return (array.shape, array.dtype.str, array.tobytes())


def _global(plan: Plan, mb_tokens: np.ndarray | None, mb_sum_l2: np.ndarray | None,
            mb_slots: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The batch's (validated) tokens and sum l^2 in global micro-batch order."""
    data = group_data(plan, mb_tokens, mb_sum_l2, mb_slots)
    return data.tokens_GxM[data.valid_GxM > 0], data.sum_l2_GxM[data.valid_GxM > 0]


def _relative_move(x_NxF: np.ndarray, y_N: np.ndarray, old: np.ndarray, new: np.ndarray
                   ) -> float:
    return float(np.median(np.abs(x_NxF @ (new - old)) / y_N))


def _design(window: list[_Obs], with_total: bool) -> tuple[np.ndarray, np.ndarray]:
    """The fit's rows (each step's path features) and times."""
    rows = [np.concatenate([o.path_x, o.total_x if with_total else np.zeros(0)]) for o in window]
    return np.asarray(rows), np.asarray([o.step_time_s for o in window])
