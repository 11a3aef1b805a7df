"""ResiHP's detector: judge each step against the predicted healthy time of that exact batch.

The OnlineCostModel (fitted online from steps judged healthy) predicts what this batch's
sequence lengths should cost under this plan; a tracked scale (EWMA of healthy steps' log
error, rate `drift`) absorbs machine-wide drift such as other jobs sharing the host, within a
few steps. A step is in excess when log(observed / predicted) is above `k` robust sigmas
(the larger of the cost model's fit noise and this detector's own recent healthy errors) and
at least `min_excess`; only `persist` excess steps in a row raise a suspicion, which the probes
then confirm and localize; two in a row suffice when both exceed `strong` thresholds (healthy
streams never showed two consecutive steps above even one threshold; a 1.5x device shows
several thresholds on every step).

When per-stage times come with the steps (the forward of one micro-batch per stage), a
second, load-robust signal watches each stage's share of them against the share its layers
and its DP group's micro-batch predict (and its own healthy baseline): a machine-wide
slowdown moves every stage together, a slow device moves only its own stage. A persistent
stage excess is also a suspicion. The stages' common level (a low quantile of their times
against their own healthy baselines, so one slow stage does not move it) tells how much of a
step's excess the whole machine shares: other processes loading the host slow every stage
alike, and that part of the excess is drift, not a fault (without it, a load switched on
raised an alarm the probes then cleared). Stage baselines are learned from the first fit of
the cost model on, so the stage signal is armed when the step signal is.

Stage times are not fitted as cost-model rows by default (`fit_stage_times`): on shared
host cores one micro-batch's forward mostly measures what the other devices run at the same
moment (an 18% robust sigma, against 2.3% for whole steps), and as rows they drowned the
step rows the predictor is judged on (MAPE 5.4% vs 2.4%).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from resihp_jax.detector.base import Detector, register
from resihp_jax.detector.verdict import StepObservation
from resihp_jax.errors import ConfigError
from resihp_jax.meshes.plan import Plan
from resihp_jax.perfmodel.costs import CostParams
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.perfmodel.fit import OnlineCostModel
from resihp_jax.perfmodel import features
from resihp_jax.perfmodel.work import group_data

# Steps learned as healthy before any step is judged (callers scheduling faults need it).
WARMUP_STEPS = 24


@register
class ResiHPDetector(Detector):
    name = "resihp"

    def __init__(self, model: ModelFacts | None = None, *,
                 cost_model: OnlineCostModel | None = None, warmup: int = WARMUP_STEPS,
                 k: float = 3.0, min_excess: float = 0.05, persist: int = 3, strong: float = 2.0,
                 drift: float = 0.2,
                 use_stage_times: bool = True, stage_min_excess: float = 0.08,
                 fit_stage_times: bool = False, **kwargs: Any) -> None:
        super().__init__(model=model, **kwargs)
        if not (isinstance(persist, int) and persist >= 2 and strong >= 1.0):
            raise ConfigError(f"resihp: persist={persist!r} must be an integer >= 2 and "
                              f"strong={strong!r} >= 1")
        self.cost = cost_model if cost_model is not None else OnlineCostModel(
            model, window=128, refit_every=16)
        self.warmup, self.k, self.min_excess, self.strong = warmup, k, min_excess, strong
        self.persist, self.drift, self.use_stage_times = persist, drift, use_stage_times
        self.fit_stage_times = fit_stage_times
        self.scale = 1.0  # machine-wide drift of healthy steps against the model
        self._learned = 0
        self._excess: list[float] = []  # log excesses of the current run of excess steps
        self.last_excess = 0.0
        self._resid: deque[float] = deque(maxlen=64)  # healthy steps' log(observed/predicted)
        self.stage_min_excess = stage_min_excess
        self._stage_base: np.ndarray | None = None  # healthy log-share of each stage
        self._level_base: np.ndarray | None = None  # healthy log(time / expected) per stage
        self._level = 0.0  # this step's machine-wide stage level against its baseline
        self._level_dev = np.zeros(0)
        self._level_spread = 0.0  # robust sigma of `_level` on healthy steps
        self._stage_spread = 0.0  # robust sigma of a stage's deviation from its baseline
        self._stage_seen = 0
        self._stage_streak = 0
        self._rebase_left = 0  # steps left in which to re-measure `scale` after a re-plan
        self._rebase_ratios: list[float] = []  # observed / raw prediction over those steps

    @property
    def noise(self) -> float:
        """Robust sigma of the step predictions: the larger of the cost model's fit noise and
        this detector's own recent healthy errors (drift included). The own errors alone are
        truncated at the threshold and miss the heavy tail of a shared host's load bursts
        (7 false alarms in 500 steps when used alone), so they may only raise the noise."""
        if len(self._resid) < 8:
            return self.cost.noise
        r = np.asarray(self._resid)
        return max(self.cost.noise, 1.4826 * float(np.median(np.abs(r - np.median(r)))))

    @property
    def threshold(self) -> float:
        return max(self.min_excess, self.k * self.noise)

    def predict(self, obs: StepObservation) -> float:
        """Healthy time of this batch under this plan (cost model times drift)."""
        return self.scale * self.cost.predict(obs.plan, obs.mb_tokens, obs.mb_sum_l2)

    def healthy_time_s(self, plan: Plan, mb_tokens: np.ndarray,
                       mb_sum_l2: np.ndarray) -> float | None:
        if not self.cost.ready or self._learned < self.warmup:
            return None
        return self.scale * self.cost.predict(plan, mb_tokens, mb_sum_l2)

    def cost_params(self) -> CostParams | None:
        # only a fit over the whole warm-up, and one that prices tokens: an early fit can
        # put every term at zero, and the scheduler cannot split work priced at nothing
        if not self.cost.ready or self._learned < self.warmup:
            return None
        params = self.cost.params
        return params if params.alpha > 0 or params.beta > 0 else None

    def rebaseline(self, steps: int = 3) -> None:
        """After a re-plan, the known-degraded cluster is the new normal: re-measure the
        drift scale over the next `steps` steps (not learned by the cost model, never
        suspected), and re-learn each stage's share, so only a new fault raises a suspicion."""
        self._rebase_left, self._rebase_ratios = steps, []
        self._excess.clear()
        self._stage_streak, self._stage_base, self._stage_seen = 0, None, 0
        self._level_base, self._level_spread = None, 0.0

    def _suspect(self, obs: StepObservation) -> bool:
        if not self.cost.ready or self._learned < self.warmup:
            if self.cost.ready:  # stage shares are judged against the fitted costs
                self._update_stage_base(self._stage_deviation(obs))
            self._learn(obs)
            return False
        if self._rebase_left > 0:
            raw = self.cost.predict(obs.plan, obs.mb_tokens, obs.mb_sum_l2)
            self._rebase_ratios.append(obs.step_time_s / raw)
            self._rebase_left -= 1
            if self._rebase_left == 0:
                self.scale = float(np.median(self._rebase_ratios))
            return False
        predicted = self.predict(obs)
        self.last_prediction_s = predicted
        excess = math.log(obs.step_time_s / predicted)
        self.last_excess = excess
        stage_dev = self._stage_deviation(obs)
        stage_hot = self._stage_hot(stage_dev)
        unexplained = excess - self._shared_level()  # what the whole machine does not share
        step_hot = unexplained > self.threshold
        if step_hot:
            self._excess.append(unexplained)
        else:
            self._excess.clear()
        if self._stage_streak >= self.persist or self._step_persistent():
            return True
        if stage_hot or step_hot:
            return False  # pending: a suspect step teaches neither the model nor the baseline
        self._update_stage_base(stage_dev)
        self._resid.append(excess)
        self.scale *= math.exp(self.drift * excess)
        self._learn(obs)
        return False

    def _shared_level(self) -> float:
        """The stages' common slowdown when it stands out of their noise, else 0: a noisy
        level subtracted on every step would blunt the step signal on a quiet host."""
        if self._stage_seen < self.warmup // 2:
            return 0.0
        floor = max(self.min_excess, self.k * self._level_spread)
        return self._level if self._level > floor else 0.0

    def _step_persistent(self) -> bool:
        run = self._excess
        return len(run) >= self.persist or (
            len(run) >= 2 and min(run[-2:]) > self.strong * self.threshold)

    def _cleared(self, obs: StepObservation) -> None:
        # the probes found every device equally fast: the excess was the machine, not a device
        if self._excess:
            self.scale *= math.exp(float(np.median(self._excess)))
        self._excess.clear()
        self._stage_streak = 0

    # ---- per-stage shares ----------------------------------------------------------------
    def _stage_deviation(self, obs: StepObservation) -> np.ndarray | None:
        """log(stage busy / expected) minus its median and its healthy baseline, [dp, pp]."""
        times = obs.stage_times_s
        self._level = 0.0
        if not self.use_stage_times or times is None or not np.all(np.asarray(times) > 0):
            return None
        p = self.cost.params
        data = group_data(obs.plan, obs.mb_tokens, obs.mb_sum_l2)
        units = features.stage_units(obs.plan, data)  # what the timed region's work is made of
        expected = units[:, :3] @ np.array([p.c, p.alpha, p.beta])
        if not np.all(expected > 0):
            expected = units[:, 1]  # no fit of the fixed/attention terms yet: tokens alone
        expected = expected.reshape(obs.plan.dp, obs.plan.pp)
        log_ratio = np.log(np.asarray(times, float) / expected)
        log_share = log_ratio - np.median(log_ratio)
        if self._stage_base is None or self._stage_base.shape != log_share.shape:
            self._stage_base, self._stage_seen = log_share, 0
            self._level_base = log_ratio
        self._level_dev = log_ratio - self._level_base
        # the second-lowest of 4 stages (lowest of 2): one slow stage never lifts it
        self._level = float(np.sort(self._level_dev.ravel())[self._level_dev.size // 4])
        return log_share - self._stage_base

    def _stage_hot(self, dev: np.ndarray | None) -> bool:
        """Is some stage's share in excess now? (counts the run of such steps)"""
        # its EWMAs (rate >= drift) forget in ~5 steps: half the warm-up is plenty
        if dev is None or self._stage_seen < self.warmup // 2:
            return False
        hot = float(dev.max()) > max(self.stage_min_excess, self.k * self._stage_spread)
        self._stage_streak = self._stage_streak + 1 if hot else 0
        return hot

    def _update_stage_base(self, dev: np.ndarray | None) -> None:
        if dev is None:
            return
        rate = max(self.drift, 1.0 / (self._stage_seen + 1))
        self._stage_base = self._stage_base + rate * dev  # type: ignore[operator]
        self._level_base = self._level_base + rate * self._level_dev  # type: ignore[operator]
        if not self._shared_level():  # noise only: a real shared slowdown would inflate it
            # mean |level| x 1.2533 is sigma for normal noise
            self._level_spread += rate * (1.2533 * abs(self._level) - self._level_spread)
        spread = 1.4826 * float(np.median(np.abs(dev)))
        self._stage_spread += rate * (spread - self._stage_spread)
        self._stage_seen += 1

    def _learn(self, obs: StepObservation) -> None:
        stages = obs.stage_times_s if self.fit_stage_times else None
        self.cost.observe(obs.plan, obs.mb_tokens, obs.mb_sum_l2, obs.step_time_s / self.scale,
                          stages)
        self._learned += 1
