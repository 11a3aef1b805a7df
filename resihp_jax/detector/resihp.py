"""ResiHP's detector: judge each step against the predicted healthy time of that exact batch.

The OnlineCostModel (fitted online from steps judged healthy) predicts what this batch's
sequence lengths should cost under this plan; a tracked scale (EWMA of healthy steps' log
error, rate `drift`) absorbs machine-wide drift such as other jobs sharing the host, within a
few steps. What is left, r = log(observed / predicted), is measured in units of the plan's own
noise sigma: the spread of r over the steps this plan ran healthy, its RMS included (clipped
at RMS_CLIP robust sigmas), so the host's own swings of a few steps, which a robust spread
leaves out and which the machine's noise floor (the CV of one batch timed again and again)
takes in, widen it as they widen that floor: the thresholds follow the machine the job runs
on rather than fixed factors. A one-sided CUSUM of those units (slack `slack` sigmas per
step, one step counting at most `decision` / 2, a suspicion at `decision`) raises a
suspicion, which the probes then confirm and localize. The stated margin: a step-level
slowdown of `REACH_SIGMAS` (4) sigmas is caught within `REACH_STEPS` (5) steps. With the
defaults and normal noise, 4 sigmas reach the decision within 5 steps all but 46 times in
10,000 (4.5 sigmas: all but 1 in 10,000; 3 sigmas: only 68 in 100), and healthy steps raise
no suspicion within 500 steps in 20,000 runs (t-distributed noise with 4 degrees of freedom:
1 run in 240); no single step (a load spike) can raise a suspicion alone. A step over the slack is
held back from learning until the CUSUM returns to zero (then it was noise, and its residual
widens the plan's sigma) or the probes clear it. (Slack 1.25 with a robust sigma alone
caught even 3 sigmas 98 times in 100, more than the margin asks, and raised suspicions on
the host's swings of 2-8 steps at 3-4 robust sigmas: `benchmarks/detection.py`.)

When per-stage times come with the steps (the forward of one micro-batch per stage), a
second, load-robust signal watches each stage's share of them against the share its layers
and its DP group's micro-batch predict (and its own healthy baseline): a machine-wide
slowdown moves every stage together, a slow device moves only its own stage. A persistent
stage excess is also a suspicion; a stage counts as in excess past `stage_k` (4) of its
healthy spreads (at 3, the swings of one micro-batch's forward on shared cores, 10-20%,
raised false alarms in healthy runs of `benchmarks/detection.py`). The stages' common level
(a low quantile of their times against their own healthy baselines, so one slow stage does
not move it) tells how much of a step's excess the whole machine shares: other processes
loading the host slow every stage alike, and that part of the excess is drift, not a fault
(without it, a load switched on raised an alarm the probes then cleared). Where the host's
CPU counters are known, the level counts only while they show other processes taking cores:
a slow device can lift every stage's time by itself (the stages wait on each other's
transfers), and taken as load, a 1.2x device's 1.12x step slowdown was learned as drift in a
full run of `benchmarks/detection.py` (corpus, seed 3) and never caught. Stage baselines are
learned from the first fit of the cost model on, so the stage signal is armed when the step
signal is.

When the host's CPU accounting comes with the steps (`StepObservation.host_cpu`), it tells
how much of an excess other processes explain: they ran on more cores than on healthy steps,
so this process got fewer of the cores it uses (min(its healthy use, cores - others) against
the same with the others' healthy level). That part is drift too, and it is known the very
step a load switches on, where the stage level needs several steps to stand out of its noise
(each switch-on otherwise cost a probe). A slow device does not raise the others' use by
itself; on a saturated host they take what the slow device leaves idle, so a fault under a
load shows partly as host load, and the stage shares (which no load moves) still see it.

Where the process keeps the host's cores busy (its step is CPU-bound, as 8 fake devices on 2
cores are), the same counters tell a slow device from a slow machine. A slow device leaves
cores idle while the others wait for it, so this process's cores fall as its step lengthens
(`benchmarks/detection.py` prints them per trial; `--data synthetic:bimodal --seed 6`: a 1.2x
device's steps at 0.91-0.96x the cores, a 2x device's at 0.64-0.71x). When the cores
themselves run slower (the machine's own swings, which raised both false alarms of a full
`benchmarks/detection.py --data synthetic:lognormal --seed 12` run: steps 6% to 16% slower
over 4-5 steps, the process at its healthy cores throughout, nothing else running), the
process burns more CPU seconds for the same batch. The part of an excess those extra seconds
explain (excess + log(cores now / healthy cores)) is the machine's, not a device's, while the
process holds its healthy cores (within HOST_MIN_CORES) and up to the stated margin
(REACH_SIGMAS sigmas): devices sharing the cores keep them busy while a slow one sleeps, so a
step slower than that is left for the probe to tell. It counts only in a job of
one process (with several, one host's slower cores are a slow device of the
job) whose healthy use is at least OWN_BOUND of the cores the others leave it: on a GPU host
the process uses a few of many cores, and a host thread spin-waiting on a slow GPU would burn
CPU in step with the wall time.

The baseline is only as healthy as the devices were while the warm-up learned it: a device
that turned slow during the warm-up is in it, and later steps never stand out against it
(a user's job slowed at step 12 of a 24-step warm-up ran on unnoticed). So CHECK_AFTER steps
after the warm-up, and every CHECK_PERIOD steps after that, the probes check every device
(`Detector.checks`, not alarms): where the host's own swings hide a slow host's share of
the step, they are what finds it.

Stage times are not fitted as cost-model rows: on shared host cores one micro-batch's
forward mostly measures what the other devices run at the same moment (an 18% robust sigma,
against 2.3% for whole steps), and as rows they drowned the step rows the predictor is
judged on (MAPE 5.4% vs 2.4%).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from resihp_jax.detector.base import Detector, register
from resihp_jax.detector.verdict import HostCpu, StepObservation
from resihp_jax.errors import ConfigError
from resihp_jax.plan import Plan
from resihp_jax.perfmodel.costs import CostParams
from resihp_jax.perfmodel.facts import ModelFacts
from resihp_jax.perfmodel.online import OnlineCostModel
from resihp_jax.perfmodel import features
from resihp_jax.perfmodel.work import group_data

# Steps learned as healthy before any step is judged (callers scheduling faults need it).
WARMUP_STEPS = 24
# The stated margin: a step-level slowdown of exp(REACH_SIGMAS x the plan's noise sigma) or
# more is caught within REACH_STEPS steps (see the module docstring for why the defaults do).
REACH_SIGMAS = 4.0
REACH_STEPS = 5
# Residuals a plan needs before its own sigma is trusted (until then: the cost model's noise
# and the other plans' sigmas, whichever is larger).
MIN_RESIDUALS = 16
STAGE_PERSIST = 3  # steps of stage excess in a row that make a suspicion
LOAD_DRIFT = 0.5  # the drift scale's rate while the stages show a load on the whole host
# other processes' CPU use beyond their healthy level that counts as a load, in cores (the
# host's tick counters step in 1/100 s, so over a step of 0.2 s one core reads +-0.05)
HOST_MIN_CORES = 0.1
# the process's step is CPU-bound (its own CPU seconds explain a slower machine) where its
# healthy use is at least this share of the cores the other processes leave it
OWN_BOUND = 0.8
# a residual counts towards the plan's RMS up to this many robust sigmas: a swing of the host
# widens the sigma, a step of a fault held back by mistake cannot blow it up
RMS_CLIP = 6.0
# steps after the warm-up before the probes check every device (`_check_due`)
CHECK_AFTER = 6
# then every CHECK_PERIOD steps (`_check_due`), or as many more as keep a probe run's stall
# within CHECK_BUDGET of the steps' time: a probe run costs a few of a GPU step's
# milliseconds (every 12 steps well under 1%), on 8 fake devices of 2 CPU cores about as
# much as one to three steps
CHECK_PERIOD, CHECK_BUDGET = 12, 0.05
# In a job of several processes (`Detector.job_checks`) the steps are timed only as a whole
# and a user's model has no stage timing, so the checks are what names a slow host: from
# step JOB_CHECK_START (the start-up's compiles are done), warm-up or not, every
# JOB_CHECK_PERIOD steps or as many more as keep a probe run within JOB_CHECK_BUDGET of the
# steps' time. A slowdown is then named at most JOB_CHECK_PERIOD + (CHECK_RUNS - 1) x
# CHECK_EVERY = 9 steps after it began (issue 46's target: 10), wherever that falls, where a
# probe run costs at most JOB_CHECK_BUDGET x JOB_CHECK_PERIOD steps (a GPU's: milliseconds;
# 4 processes x 2 fake devices on 2 cores: 0.5 s against steps of 0.3-2 s)
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
        self.warmup, self.slack, self.decision = warmup, slack, decision
        self.drift, self.min_noise, self.k = drift, min_noise, k
        self.level_min_excess = level_min_excess
        self.scale = 1.0  # machine-wide drift of healthy steps against the model
        self._learned = 0
        self.cusum = 0.0  # accumulated excess beyond the slack, in noise sigmas
        # steps held back from learning: (observation, excess, unexplained)
        self._held: list[tuple[StepObservation, float, float]] = []
        self.last_excess = 0.0
        # the last steps judged: (step, log excess over the prediction, unexplained excess in
        # noise sigmas), what an alarm rests on (benchmarks/detection.py prints it)
        self.evidence: deque[tuple[int, float, float]] = deque(maxlen=REACH_STEPS)
        self._resid: dict[Plan, deque[float]] = {}  # healthy steps' unexplained log excess
        self._sigma: dict[Plan, float] = {}
        self._plan: Plan | None = None  # the plan of the last step judged
        self.stage_min_excess, self.stage_k = stage_min_excess, stage_k
        self._stage_base: np.ndarray | None = None  # healthy log-share of each stage
        self._level_base: np.ndarray | None = None  # healthy log(time / expected) per stage
        self._level = 0.0  # this step's machine-wide stage level against its baseline
        self._shared = 0.0  # the part of a step's excess the whole machine explains
        self._load = 0.0  # the part of it other processes' load explains (stages or counters)
        self._stage_shared = 0.0  # the part the stages' level shows
        self._level_dev = np.zeros(0)
        self._level_spread = 0.0  # robust sigma of `_level` on healthy steps
        self._stage_spread = 0.0  # robust sigma of a stage's deviation from its baseline
        self._stage_seen = 0
        self._stage_streak = 0
        self._cpu_base: tuple[float, float] | None = None  # healthy (own, others) cores
        self._cpu_seen = 0
        # the devices were checked by a probe when the warm-up ended (`_check_due`)
        self._baseline_checked = False
        self._since_warm = 0  # steps judged since the warm-up ended (for the check)
        self._recent: deque[float] = deque(maxlen=CHECK_PERIOD)  # the last steps' times
        self._rebase_left = 0  # steps left in which to re-measure `scale` after a re-plan
        self._rebase_ratios: list[float] = []  # observed / raw prediction over those steps

    def noise_of(self, plan: Plan | None) -> float:
        """Sigma of the log prediction error of healthy steps under `plan`: the largest of
        1.4826 x MAD, the distance from the median to the 90th percentile / 1.28 (load bursts
        on a shared host make the upper tail heavier than a normal one) and the RMS of the
        errors clipped at RMS_CLIP of those (the host's swings of a few steps, which the two
        robust figures leave out and which raised false alarms). A plan with fewer than
        MIN_RESIDUALS of its own (the first steps after a re-plan) gets twice the largest sigma
        known (other plans', the cost model's fit noise), or what its own first steps show
        if that is more: its noise is not known yet, and a false alarm then costs a probe."""
        own = self._sigma.get(plan)
        if own is not None:
            return own
        known = list(self._sigma.values())
        if self.cost.ready:
            known.append(self.cost.noise)
        first = np.asarray(self._resid.get(plan, ()))
        early = 1.4826 * float(np.median(np.abs(first - np.median(first)))) \
            if first.size >= 6 else 0.0
        return max(self.min_noise, 2.0 * max(known, default=0.0), early)

    @property
    def noise(self) -> float:
        """The noise sigma of the plan last judged."""
        return self.noise_of(self._plan)

    @property
    def threshold(self) -> float:
        """Log excess per step beyond which a step adds to the suspicion."""
        return self.slack * self.noise

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
        """Every step while the evidence is in doubt: the warm-up (the stage baselines are
        learned there), the steps after a re-plan, and while a step over the slack, a
        stage in excess or a suspicion is unresolved. A slow device is then localized from
        consecutive stage times (STAGE_PERSIST of them in a row), and a load on the host
        is told by the stages' common level, as when every step was timed."""
        return (self._warming() or self._rebase_left > 0 or self.cusum > 0
                or bool(self._held) or self._stage_streak > 0
                or self._stage_seen < self.warmup // 2)

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
        self.cusum, self._held = 0.0, []
        self._stage_streak, self._stage_base, self._stage_seen = 0, None, 0
        self._level_base, self._level_spread, self._shared, self._load = None, 0.0, 0.0, 0.0
        self._stage_shared = 0.0
        self._cpu_base, self._cpu_seen = None, 0  # the new plan uses the cores its own way

    def _check_due(self) -> bool:
        """CHECK_AFTER steps after the warm-up, then every CHECK_PERIOD steps. The baseline
        is only as healthy as the devices were while it was learned: a device that turned
        slow during the warm-up (or was slow from the start) is in it, and the steps never
        stand out against it (a user's job slowed at step 12 of a 24-step warm-up ran on
        unnoticed); and where the host's own swings are as large as a slow host's share of
        the step (4 processes on 2 loaded cores: a 3x process lengthened the step ~1.4x
        against a noise sigma of ~25%) no step stands out either. The probes compare the
        devices with each other and need neither. Not in the warm-up, nor at its end: a job's
        first steps share the cores with its compiles (a standby's included; the trainer
        starts compiling the likely next plans when the warm-up ends), and on shared cores a
        process busy compiling makes its devices' probes slow (checks from step 6, 12 or 18
        named healthy hosts of a 4-process job at 1.5x-3x in every run of a check). Every
        input here is the same in every process of a job (the steps seen), so they all run
        the probes' collectives alike. In a job of several processes (`job_checks`), from
        JOB_CHECK_START on, warm-up or not: each process times its own devices there, all at
        once, which a compile elsewhere does not single out (probes.py `_LocalProbe`)."""
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
        return not self.cost.ready or self._learned < self.warmup or not self._sigma

    def _suspect(self, obs: StepObservation) -> bool:
        self._recent.append(obs.step_time_s)
        if self._warming():
            if self.cost.ready:  # judged against the fit so far, before it learns the step:
                # out-of-sample errors, as later steps will show (the fit's own residuals
                # on its first rows are far smaller); drift is tracked from here on too
                excess = math.log(obs.step_time_s / self.predict(obs))
                self._add_residual(obs.plan, excess)
                self._update_stage_base(self._stage_deviation(obs))
                self.scale *= math.exp(self.drift * excess)
            self._update_cpu_base(obs.host_cpu, self.drift)
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
        self.last_excess = excess
        stage_dev = self._stage_deviation(obs)
        stage_hot = self._stage_hot(stage_dev)
        host = self._host_level(obs.host_cpu)
        self._stage_shared = self._shared_level() if self._level_may_explain(obs.host_cpu, host) \
            else 0.0
        self._load = max(self._stage_shared, host)
        self._shared = max(self._stage_shared, host + self._own_level(obs.host_cpu, excess))
        unexplained = excess - self._shared  # what the whole machine does not share
        units = unexplained / self.noise_of(obs.plan)
        self.evidence.append((obs.step, excess, units))
        self.cusum = max(0.0, self.cusum + min(units - self.slack, self.decision / 2))
        suspected = self.cusum >= self.decision or self._stage_streak >= STAGE_PERSIST
        if suspected or units > self.slack or stage_hot:
            # it added to the suspicion: it teaches neither the model nor the baselines (yet)
            self._held.append((obs, excess, unexplained))
            del self._held[:-128]  # a swing that never resolves is learned no more
            return suspected
        if self.cusum == 0:
            self._release()  # the run of excess ended without a suspicion: it was noise
        self._update_stage_base(stage_dev)
        self._learn_healthy(obs, excess, unexplained)
        return False

    def _learn_healthy(self, obs: StepObservation, excess: float, unexplained: float) -> None:
        """The step was healthy: its error is noise of this plan (the part the machine does
        not explain), all of its excess is drift (the stage baselines absorb a load at the
        same rate, so a load keeps being explained while the scale catches up)."""
        self._add_residual(obs.plan, unexplained)
        # under a load (the stages or the counters show it), catch up fast: the stage
        # baselines absorb the load too, and what the scale had not caught when they have
        # would be excess. The CPU seconds' part is a step's own swing: at the usual rate.
        rate = max(self.drift, LOAD_DRIFT) if self._load else self.drift
        self.scale *= math.exp(rate * excess)
        # the host's healthy use moves as fast as the scale: what the host explains is the
        # part of a load the scale has not taken in yet
        self._update_cpu_base(obs.host_cpu, rate)
        self._learn(obs)

    def _add_residual(self, plan: Plan, resid: float) -> None:
        window = self._resid.setdefault(plan, deque(maxlen=128))
        window.append(resid)
        if len(window) >= MIN_RESIDUALS:
            # (sorted once: np.median and np.quantile each sort again, 0.4 ms a step)
            r = np.asarray(window)
            sorted_r = np.sort(r)
            med = _sorted_quantile(sorted_r, 0.5)
            mad_sigma = 1.4826 * _sorted_quantile(np.sort(np.abs(r - med)), 0.5)
            tail_sigma = (_sorted_quantile(sorted_r, 0.9) - med) / 1.2816
            robust = max(self.min_noise, mad_sigma, tail_sigma)
            clipped = np.clip(r - med, -RMS_CLIP * robust, RMS_CLIP * robust)
            self._sigma[plan] = max(robust, float(np.sqrt(np.mean(clipped ** 2))))

    def _release(self) -> None:
        """Learn the held steps: they were healthy after all (the stage baselines learn
        only from steps judged healthy at once)."""
        held, self._held = self._held, []
        for obs, excess, unexplained in held:
            self._learn_healthy(obs, excess, unexplained)

    def _shared_level(self) -> float:
        """The stages' common slowdown when it stands out of their noise, else 0: a noisy
        level subtracted on every step would blunt the step signal on a quiet host. Once it
        stood out, half that suffices while it lasts: a load stays a while, and its level,
        measured on a few stages' single forwards, swings around it."""
        if self._stage_seen < self.warmup // 2:
            return 0.0
        floor = max(self.level_min_excess, self.k * self._level_spread)
        return self._level if self._level > (floor / 2 if self._stage_shared else floor) \
            else 0.0

    def _level_may_explain(self, cpu: HostCpu | None, host: float) -> bool:
        """May the stages' common level count as a load on the whole machine? Where the
        host's CPU counters are known, only while they show other processes taking cores: a
        slow device can lift every stage's time by itself (the stages wait on each other's
        transfers), and taken as load that slowdown was learned as drift and never caught."""
        return not self._cpu_known(cpu) or host > 0.0

    def _cpu_known(self, cpu: HostCpu | None) -> bool:
        """Are the host's counters here, with a healthy level learned over half a warm-up?"""
        return cpu is not None and self._cpu_base is not None \
            and self._cpu_seen >= self.warmup // 2

    def _host_level(self, cpu: HostCpu | None) -> float:
        """The log slowdown other processes explain by running on more cores than they do
        on healthy steps: this process got min(own, cores - others) cores against
        min(own, cores - healthy others), `own` its healthy use. 0 within HOST_MIN_CORES
        of their healthy use (tick noise), and where the host has cores to spare (a GPU
        host whose process needs few)."""
        if not self._cpu_known(cpu):
            return 0.0
        own, others = self._cpu_base
        if cpu.others - others < HOST_MIN_CORES:
            return 0.0
        least = 0.05 * cpu.cores  # a host taken whole still leaves us a little
        healthy = max(least, min(own, cpu.cores - others))
        now = max(least, min(own, cpu.cores - cpu.others))
        return max(0.0, math.log(healthy / now))

    def _own_level(self, cpu: HostCpu | None, excess: float) -> float:
        """The log slowdown this process's own extra CPU seconds explain: excess + log(its
        cores now / its healthy cores), >= 0 (a slow device leaves cores idle: its excess
        comes with fewer cores and stays unexplained; slower cores take more seconds at the
        same cores). 0 where the counters are unknown, where these cores do not run every
        device of the job (with several processes, one host's slower cores are a slow
        device), where the step is not CPU-bound (healthy use under OWN_BOUND of the cores
        the others leave) or where the process's cores fell (a device left them idle); at
        most the stated margin."""
        if not self._cpu_known(cpu) or not cpu.every_device:
            return 0.0
        own, others = self._cpu_base
        if own < OWN_BOUND * (cpu.cores - others) or own <= 0:
            return 0.0
        if cpu.own < own - HOST_MIN_CORES:
            return 0.0  # cores left idle: a device keeps the others waiting
        explained = max(0.0, excess + math.log(max(cpu.own, 1e-3 * own) / own))
        # Up to the stated margin only. Devices sharing cores keep them busy while a slow one
        # sleeps (a `resihp demo` run missed its 3x device altogether: the process's cores
        # fell far less than its steps lengthened), so past the margin the step is a
        # device's to check, and the probe tells which (a slower machine: none).
        return min(explained, REACH_SIGMAS * self.noise_of(self._plan))

    def _update_cpu_base(self, cpu: HostCpu | None, rate: float) -> None:
        if cpu is None:
            return
        if self._cpu_base is None:
            self._cpu_base, self._cpu_seen = (cpu.own, cpu.others), 0
        rate = max(rate, 1.0 / (self._cpu_seen + 1))
        own, others = self._cpu_base
        self._cpu_base = (own + rate * (cpu.own - own), others + rate * (cpu.others - others))
        self._cpu_seen += 1

    def _cleared(self, obs: StepObservation) -> None:
        # the probes found every device equally fast: the excess was the machine, not a
        # device. Move the drift scale by it and learn the held steps as healthy steps
        # around that new level.
        if self._held:
            shift = float(np.median([u for _, _, u in self._held]))
            self._held = [(o, e - shift, u - shift) for o, e, u in self._held]
            self.scale *= math.exp(shift)
            self._release()
        self.cusum = 0.0
        self._stage_streak = 0

    # ---- per-stage shares ----------------------------------------------------------------
    def _stage_deviation(self, obs: StepObservation) -> np.ndarray | None:
        """log(stage busy / expected) minus its median and its healthy baseline, [dp, pp]."""
        times = obs.stage_times_s
        self._level = 0.0
        if times is None or not np.all(np.asarray(times) > 0):
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
        hot = float(dev.max()) > max(self.stage_min_excess, self.stage_k * self._stage_spread)
        self._stage_streak = self._stage_streak + 1 if hot else 0
        return hot

    def _update_stage_base(self, dev: np.ndarray | None) -> None:
        if dev is None:
            return
        rate = max(self.drift, 1.0 / (self._stage_seen + 1))
        self._stage_base = self._stage_base + rate * dev  # type: ignore[operator]
        self._level_base = self._level_base + rate * self._level_dev  # type: ignore[operator]
        if not self._stage_shared:  # noise only: a real shared slowdown would inflate it
            # mean |level| x 1.2533 is sigma for normal noise
            self._level_spread += rate * (1.2533 * abs(self._level) - self._level_spread)
        spread = 1.4826 * float(np.median(np.abs(dev)))
        self._stage_spread += rate * (spread - self._stage_spread)
        self._stage_seen += 1

    def _learn(self, obs: StepObservation) -> None:
        self.cost.observe(obs.plan, obs.mb_tokens, obs.mb_sum_l2, obs.step_time_s / self.scale)
        self._learned += 1


def _sorted_quantile(sorted_N: np.ndarray, q: float) -> float:
    """np.quantile's (linear) `q` quantile of an already sorted array."""
    at = q * (len(sorted_N) - 1)
    lo = int(math.floor(at))
    hi = min(lo + 1, len(sorted_N) - 1)
    return float(sorted_N[lo] + (sorted_N[hi] - sorted_N[lo]) * (at - lo))
