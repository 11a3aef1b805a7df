"""ResiHP's detector: judge each step against the predicted healthy time of that exact batch.

The OnlineCostModel (fitted online from steps judged healthy) predicts what the batch should
cost under its plan; a tracked scale (EWMA of healthy steps' log error, rate `drift`) absorbs
machine-wide drift such as other jobs sharing the host within a few steps. What is left of a
step, less what the whole machine explains, is judged by the four signals of
detector/signals.py; the probes confirm and localize a suspicion. A step over the slack is
held back from learning until the CUSUM returns to zero (then it was noise, and its residual
widens the plan's sigma) or the probes clear it. The probes also check every device on a
schedule of their own (`_check_due`; docs/DESIGN.md, data flow step 4).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from resihp_jax.detector.base import Detector, register
from resihp_jax.detector.signals import CpuAccounting, SharedLevel, StageShares, StepSignal
from resihp_jax.detector.verdict import StepObservation
from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan
from resihp_jax.perfmodel.costs import CostParams
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.perfmodel.online import OnlineCostModel

# Steps learned as healthy before any step is judged (callers scheduling faults need it).
WARMUP_STEPS = 24
# The stated margin: a step-level slowdown of exp(REACH_SIGMAS x the plan's noise sigma) or
# more is caught within REACH_STEPS steps (`StepSignal` says why the defaults do).
REACH_SIGMAS = 4.0
REACH_STEPS = 5
LOAD_DRIFT = 0.5  # the drift scale's rate while the stages show a load on the whole host
# steps after the warm-up before the probes check every device (`_check_due`)
CHECK_AFTER = 6
# then every CHECK_PERIOD steps (`_check_due`), or as many more as keep a probe run's stall
# within CHECK_BUDGET of the steps' time: a probe run costs a few of a GPU step's
# milliseconds (every 12 steps well under 1%), on 8 fake devices of 2 CPU cores about as
# much as one to three steps
CHECK_PERIOD, CHECK_BUDGET = 12, 0.05
# With `Detector.job_checks` the checks are what names a slow host (steps timed only as a
# whole, no stage timing): from step JOB_CHECK_START (start-up compiles done), every
# JOB_CHECK_PERIOD steps within JOB_CHECK_BUDGET, so within 5 + (CHECK_RUNS - 1) x CHECK_EVERY
# = 9 steps of its onset (issue 46's target: 10); a probe run: a GPU's milliseconds, 0.5 s
# for 4 processes x 2 fake devices on 2 cores against steps of 0.3-2 s
JOB_CHECK_START, JOB_CHECK_PERIOD, JOB_CHECK_BUDGET = 4, 5, 0.25
# a refit of the cost model after its first runs beside the steps and takes effect this many
# steps after it began (perfmodel/online.py): a window's refit took 44 ms on 2 CPU cores, a
# whole step of a GPU's, every 16-64 steps
REFIT_LAG = 2


@register
class ResiHPDetector(Detector):
    name = "resihp"

    def __init__(self, model: ModelFacts | None = None, *, warmup: int = WARMUP_STEPS,
                 slack: float = 2.0, decision: float = 4.0, drift: float = 0.2,
                 min_noise: float = 0.002, k: float = 3.0, level_min_excess: float = 0.05,
                 stage_min_excess: float = 0.08, stage_k: float = 4.0, **kwargs: Any) -> None:
        super().__init__(model=model, **kwargs)
        if not (slack >= 0 and decision > 0 and min_noise > 0 and stage_k > 0):
            raise ConfigError(f"resihp: slack={slack!r} must be >= 0, decision={decision!r}, "
                              f"min_noise={min_noise!r} and stage_k={stage_k!r} > 0 (in noise "
                              "sigmas)")
        # The shared-core terms are always in the predictor's model (each >= 0, so where
        # devices really run in parallel the fit leaves them at 0): left to the cost model's
        # own choice they came in only after ~90 steps of 8 fake devices on 2 cores, and the
        # pipeline-only fit before that erred 1.4x the machine's noise floor (0.95x with them).
        self.cost = OnlineCostModel(model, window=128, refit_every=16, mode="contention",
                                    max_refit_every=64, refit_lag=REFIT_LAG)
        self.warmup, self.drift = warmup, drift
        self.step_signal = StepSignal(slack, decision, min_noise)
        self.stage_shares = StageShares(warmup, drift, stage_min_excess, stage_k)
        self.shared_level = SharedLevel(warmup, k, level_min_excess)
        self.cpu_accounting = CpuAccounting(warmup)
        self.scale = 1.0  # machine-wide drift of healthy steps against the model
        self._learned = 0
        # steps held back from learning: (observation, excess, unexplained)
        self._held: list[tuple[StepObservation, float, float]] = []
        # the last steps judged: (step, log excess over the prediction, unexplained excess in
        # noise sigmas), what an alarm rests on (benchmarks/detection.py prints it)
        self.evidence: deque[tuple[int, float, float]] = deque(maxlen=REACH_STEPS)
        self._plan: Plan | None = None  # the plan of the last step judged
        # the part of the last step's excess other processes' load explains (stages or counters)
        self._load = 0.0
        # the devices were checked by a probe when the warm-up ended (`_check_due`)
        self._baseline_checked = False
        self._since_warm = 0  # steps judged since the warm-up ended (for the check)
        self._recent: deque[float] = deque(maxlen=CHECK_PERIOD)  # the last steps' times
        self._rebase_left = 0  # steps left in which to re-measure `scale` after a re-plan
        self._rebase_ratios: list[float] = []  # observed / raw prediction over those steps

    def noise_of(self, plan: Plan | None) -> float:
        """Sigma of healthy steps' log prediction error under `plan` (`StepSignal.noise_of`)."""
        return self.step_signal.noise_of(plan, self.cost.noise if self.cost.ready else None)

    @property
    def slack(self) -> float:
        """Noise sigmas a step may exceed its prediction by before it adds to the CUSUM."""
        return self.step_signal.slack

    @property
    def threshold(self) -> float:
        """Log excess per step beyond which a step adds to the suspicion (the last plan's)."""
        return self.slack * self.noise_of(self._plan)

    def reach(self, plan: Plan) -> float:
        """The step-level slowdown this detector catches within REACH_STEPS steps on `plan`."""
        return math.exp(REACH_SIGMAS * self.noise_of(plan))

    def predict(self, obs: StepObservation) -> float:
        """Healthy time of this batch under this plan (cost model times drift)."""
        return self.scale * self.cost.predict(obs.plan, obs.mb_tokens, obs.mb_sum_l2)

    def healthy_time_s(self, plan: Plan, mb_tokens: np.ndarray,
                       mb_sum_l2: np.ndarray) -> float | None:
        if self._warming():
            return None
        return self.scale * self.cost.predict(plan, mb_tokens, mb_sum_l2)

    def prediction_s(self, plan: Plan, mb_tokens: np.ndarray,
                     mb_sum_l2: np.ndarray) -> float | None:
        """None while the drift scale is re-measured after a re-plan (those steps are
        judged against nothing; a hang deadline still comes from `healthy_time_s`)."""
        if self._rebase_left > 0:
            return None
        return self.healthy_time_s(plan, mb_tokens, mb_sum_l2)

    def wants_stage_times(self) -> bool:
        """Every step while the evidence is in doubt (the warm-up, the steps after a re-plan,
        an unresolved step over the slack, stage excess or suspicion): the stage signals
        then see consecutive steps (STAGE_PERSIST in a row), as when every step was timed."""
        return (self._warming() or self._rebase_left > 0 or self.step_signal.cusum > 0
                or bool(self._held) or self.stage_shares.in_doubt())

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
        super().rebaseline(steps)
        self._rebase_left, self._rebase_ratios = steps, []
        self.step_signal.reset()
        self._held = []
        self.stage_shares.reset()
        self.shared_level.reset()
        self._load = 0.0
        self.cpu_accounting.reset()  # the new plan uses the cores its own way

    def _check_due(self) -> bool:
        """CHECK_AFTER steps after the warm-up, then every `check_period()` steps. A device
        slow since the warm-up is in the baseline (a user's job slowed at step 12 of a 24-step
        warm-up ran on unnoticed), and where the host's swings are as large as a slow host's
        share of the step no step stands out either: the probes compare the devices with each
        other and need neither. Not in the warm-up, nor at its end: a job's first steps share
        the cores with its compiles (the trainer's standby and likely next plans), which make
        its probes slow (figures: docs/DESIGN.md, data flow step 4). Every input is the same
        in every process of a job, so all run the probes' collectives alike. With
        `job_checks`, from JOB_CHECK_START on, warm-up or not: each process times its own
        devices, all at once, which a compile elsewhere does not single out (`_LocalProbe`)."""
        if self.job_checks:
            self._since_warm += 1
            if self.steps < JOB_CHECK_START or self._since_warm < self.check_period(
                    JOB_CHECK_PERIOD, JOB_CHECK_BUDGET):
                return False
            self._since_warm = 0
            return True
        if self._warming():
            return False
        self._since_warm += 1
        if not self._baseline_checked:
            if self._since_warm <= CHECK_AFTER:
                return False
            self._baseline_checked, self._since_warm = True, 0
            return True
        if self._since_warm < self.check_period():
            return False
        self._since_warm = 0
        return True

    def check_period(self, period: int = CHECK_PERIOD, budget: float = CHECK_BUDGET) -> int:
        """Steps between checks: `period`, or more where a probe run stalls training for
        more than `budget` of that many steps (from the last run's stall and the recent
        steps' median, both the same in every process of a job)."""
        if not self.last_check_s or not self._recent:
            return period
        step_s = float(np.median(self._recent))
        return max(period, math.ceil(self.last_check_s / (budget * step_s)))

    def _warming(self) -> bool:
        return not self.cost.ready or self._learned < self.warmup \
            or not self.step_signal.knows_noise()

    def _suspect(self, obs: StepObservation) -> bool:
        self._recent.append(obs.step_time_s)
        if self._warming():
            if self.cost.ready:  # judged against the fit so far, before it learns the step:
                # out-of-sample errors, as later steps will show (the fit's own residuals
                # on its first rows are far smaller); drift is tracked from here on too
                excess = math.log(obs.step_time_s / self.predict(obs))
                self.step_signal.learn(obs.plan, excess)
                self._learn_stages(self._stage_deviation(obs))
                self.scale *= math.exp(self.drift * excess)
            self.cpu_accounting.learn(obs.host_cpu, self.drift)
            self._learn(obs)
            return False
        if self._rebase_left > 0:
            raw = self.cost.predict(obs.plan, obs.mb_tokens, obs.mb_sum_l2)
            self._rebase_ratios.append(obs.step_time_s / raw)
            self._rebase_left -= 1
            if self._rebase_left == 0:
                self.scale = float(np.median(self._rebase_ratios))
            return False
        self._plan = obs.plan
        predicted = self.predict(obs)
        self.last_prediction_s = predicted
        excess = math.log(obs.step_time_s / predicted)
        stage_dev = self._stage_deviation(obs)
        stage_hot = self.stage_shares.hot(stage_dev)
        cpu = obs.host_cpu
        host = self.cpu_accounting.host_level(cpu)
        stage_shared = self.shared_level.explains(self.cpu_accounting.known(cpu), host)
        self._load = max(stage_shared, host)
        noise = self.noise_of(obs.plan)
        own = self.cpu_accounting.own_level(cpu, excess, REACH_SIGMAS * noise)
        shared = max(stage_shared, host + own)  # the part the whole machine explains
        unexplained = excess - shared  # what the whole machine does not share
        units = unexplained / noise
        self.evidence.append((obs.step, excess, units))
        suspected = self.step_signal.add(units) or self.stage_shares.persists()
        if suspected or units > self.slack or stage_hot:
            # it added to the suspicion: it teaches neither the model nor the baselines (yet)
            self._held.append((obs, excess, unexplained))
            del self._held[:-128]  # a swing that never resolves is learned no more
            return suspected
        if self.step_signal.cusum == 0:
            self._release()  # the run of excess ended without a suspicion: it was noise
        self._learn_stages(stage_dev)
        self._learn_healthy(obs, excess, unexplained)
        return False

    def _learn_healthy(self, obs: StepObservation, excess: float, unexplained: float) -> None:
        """The step was healthy: the part of its error the machine does not explain is noise
        of this plan, all of its excess is drift."""
        self.step_signal.learn(obs.plan, unexplained)
        # under a load (the stages or the counters show it), catch up fast: the stage
        # baselines absorb the load too, and what the scale had not caught when they have
        # would be excess. The CPU seconds' part is a step's own swing: at the usual rate.
        rate = max(self.drift, LOAD_DRIFT) if self._load else self.drift
        self.scale *= math.exp(rate * excess)
        # the host's healthy use moves as fast as the scale: what the host explains is the
        # part of a load the scale has not taken in yet
        self.cpu_accounting.learn(obs.host_cpu, rate)
        self._learn(obs)

    def _release(self) -> None:
        """Learn the held steps: they were healthy after all (the stage baselines learn
        only from steps judged healthy at once)."""
        held, self._held = self._held, []
        for obs, excess, unexplained in held:
            self._learn_healthy(obs, excess, unexplained)

    def _cleared(self, obs: StepObservation) -> None:
        # the probes found every device equally fast: the excess was the machine, not a
        # device. Move the drift scale by it and learn the held steps as healthy steps
        # around that new level.
        if self._held:
            shift = float(np.median([u for _, _, u in self._held]))
            self._held = [(o, e - shift, u - shift) for o, e, u in self._held]
            self.scale *= math.exp(shift)
            self._release()
        self.step_signal.reset()
        self.stage_shares.calm()

    def _stage_deviation(self, obs: StepObservation) -> np.ndarray | None:
        """The step's stage times against the cost model: the shared level measured, each
        stage's share against its baseline returned ([dp, pp]; None without stage times)."""
        log_ratio = self.stage_shares.log_ratio(obs, self.cost.params)
        self.shared_level.measure(log_ratio)
        return self.stage_shares.deviation(log_ratio)

    def _learn_stages(self, dev: np.ndarray | None) -> None:
        """A healthy step's stage times into the stage and the shared level's baselines."""
        if dev is None:
            return
        self.shared_level.learn(self.stage_shares.learn(dev))

    def _learn(self, obs: StepObservation) -> None:
        self.cost.observe(obs.plan, obs.mb_tokens, obs.mb_sum_l2, obs.step_time_s / self.scale)
        self._learned += 1

