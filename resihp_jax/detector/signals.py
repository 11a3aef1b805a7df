"""The four signals ResiHPDetector (detector/resihp.py) composes, one job each. Each keeps
only its own state; the detector decides what a step's excess is made of and when they learn.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from resihp_jax.detector.verdict import HostCpu, StepObservation
from resihp_jax.plan import Plan
from resihp_jax.perfmodel import features
from resihp_jax.perfmodel.costs import CostParams
from resihp_jax.perfmodel.work import group_data

# Residuals a plan needs before its own sigma is trusted (until then: the cost model's noise
# and the other plans' sigmas, whichever is larger).
MIN_RESIDUALS = 16
# a residual counts towards the plan's RMS up to this many robust sigmas: a swing of the host
# widens the sigma, a step of a fault held back by mistake cannot blow it up
RMS_CLIP = 6.0
STAGE_PERSIST = 3  # steps of stage excess in a row that make a suspicion
# other processes' CPU use beyond their healthy level that counts as a load, in cores (the
# host's tick counters step in 1/100 s, so over a step of 0.2 s one core reads +-0.05)
HOST_MIN_CORES = 0.1
# the process's step is CPU-bound (its own CPU seconds explain a slower machine) where its
# healthy use is at least this share of the cores the other processes leave it
OWN_BOUND = 0.8


class StepSignal:
    """The step signal: a step's log excess the machine does not explain, in units of its
    plan's noise sigma, summed by a one-sided CUSUM (`slack` sigmas a step, one step counting
    at most `decision` / 2, a suspicion at `decision`). The sigma takes in the RMS of healthy
    steps' errors (clipped at RMS_CLIP robust sigmas): the host's swings of a few steps, which
    a robust spread leaves out, widen it as they widen the machine's noise floor, so the
    thresholds follow the machine, not fixed factors. With the defaults and normal noise, 4
    sigmas (the stated margin) reach the decision within 5 steps all but 46 times in 10,000
    (4.5 sigmas: 1 in 10,000; 3 sigmas: only 68 in 100), and healthy steps raise no suspicion
    within 500 steps in 20,000 runs (t-distributed noise of 4 degrees of freedom: 1 run in
    240); no single step (a load spike) raises one alone. (Slack 1.25 with a robust sigma
    alone caught even 3 sigmas 98 times in 100, and raised suspicions on the host's swings of
    2-8 steps at 3-4 robust sigmas: `benchmarks/detection.py`.)"""

    def __init__(self, slack: float, decision: float, min_noise: float) -> None:
        self.slack, self.decision, self.min_noise = slack, decision, min_noise
        self.cusum = 0.0  # accumulated excess beyond the slack, in noise sigmas
        self._resid: dict[Plan, deque[float]] = {}  # healthy steps' unexplained log excess
        self._sigma: dict[Plan, float] = {}

    def noise_of(self, plan: Plan | None, fit_noise: float | None) -> float:
        """Sigma of healthy steps' log prediction error under `plan` (`learn`). A plan with
        fewer than MIN_RESIDUALS of its own (just after a re-plan) gets twice the largest sigma
        known (other plans', the cost model's `fit_noise`), or its first steps' if more: its
        noise is not known yet, and a false alarm then costs a probe."""
        own = self._sigma.get(plan)
        if own is not None:
            return own
        known = list(self._sigma.values())
        if fit_noise is not None:
            known.append(fit_noise)
        first = np.asarray(self._resid.get(plan, ()))
        early = 1.4826 * float(np.median(np.abs(first - np.median(first)))) \
            if first.size >= 6 else 0.0
        return max(self.min_noise, 2.0 * max(known, default=0.0), early)

    def knows_noise(self) -> bool:
        """Has some plan run healthy long enough (MIN_RESIDUALS steps) for its own sigma?"""
        return bool(self._sigma)

    def learn(self, plan: Plan, resid: float) -> None:
        """A healthy step's residual under `plan`: its sigma is the largest of 1.4826 x MAD,
        (90th percentile - median) / 1.28 (load bursts on a shared host make the upper tail
        heavy) and the RMS clipped at RMS_CLIP of those (the host's swings of a few steps,
        which the robust figures leave out, raised false alarms)."""
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

    def add(self, units: float) -> bool:
        """A judged step's unexplained excess (noise sigmas) into the CUSUM: a suspicion?"""
        self.cusum = max(0.0, self.cusum + min(units - self.slack, self.decision / 2))
        return self.cusum >= self.decision

    def reset(self) -> None:
        """The suspicion is settled (the probes cleared it, or a re-plan): start from zero."""
        self.cusum = 0.0


class StageShares:
    """The stage-share signal: each stage's share of the step's per-stage times (one
    micro-batch's forward) against the share its work predicts and its healthy baseline. A
    machine-wide slowdown moves every stage together, a slow device only its own. A stage past
    `k` (4) healthy spreads for STAGE_PERSIST steps in a row is a suspicion (at 3, one
    forward's 10-20% swings on shared cores raised false alarms in `benchmarks/detection.py`).

    Stage times are not fitted as cost-model rows: on shared host cores one micro-batch's
    forward mostly measures what the other devices run at the same moment (an 18% robust
    sigma, against 2.3% for whole steps), and as rows they drowned the step rows the predictor
    is judged on (MAPE 5.4% vs 2.4%)."""

    def __init__(self, warmup: int, drift: float, min_excess: float, k: float) -> None:
        # its EWMAs (rate >= drift) forget in ~5 steps: half the warm-up is plenty
        self.armed_after = warmup // 2
        self.drift, self.min_excess, self.k = drift, min_excess, k
        self.base: np.ndarray | None = None  # healthy log-share of each stage
        self.spread = 0.0  # robust sigma of a stage's deviation from its baseline
        self.seen = 0  # steps its baseline learned
        self.streak = 0  # steps in a row with a stage in excess

    @staticmethod
    def log_ratio(obs: StepObservation, params: CostParams) -> np.ndarray | None:
        """log(stage busy / expected) of each stage, [dp, pp], under the cost model's
        `params`; None where the step has no stage times (or one is not positive)."""
        times = obs.stage_times_s
        if times is None or not np.all(np.asarray(times) > 0):
            return None
        data = group_data(obs.plan, obs.mb_tokens, obs.mb_sum_l2)
        units = features.stage_units(obs.plan, data)  # what the timed region's work is made of
        expected = units[:, :3] @ np.array([params.c, params.alpha, params.beta])
        if not np.all(expected > 0):
            expected = units[:, 1]  # no fit of the fixed/attention terms yet: tokens alone
        expected = expected.reshape(obs.plan.dp, obs.plan.pp)
        return np.log(np.asarray(times, float) / expected)

    def deviation(self, log_ratio: np.ndarray | None) -> np.ndarray | None:
        """Each stage's log-share (its `log_ratio` minus their median) minus its healthy
        baseline, [dp, pp]; the first step (or a new shape) starts the baseline."""
        if log_ratio is None:
            return None
        log_share = log_ratio - np.median(log_ratio)
        if self.base is None or self.base.shape != log_share.shape:
            self.base, self.seen = log_share, 0
        return log_share - self.base

    def hot(self, dev: np.ndarray | None) -> bool:
        """Is some stage's share in excess now? (counts the run of such steps)"""
        if dev is None or self.seen < self.armed_after:
            return False
        hot = float(dev.max()) > max(self.min_excess, self.k * self.spread)
        self.streak = self.streak + 1 if hot else 0
        return hot

    def persists(self) -> bool:
        """Has a stage been in excess long enough for a suspicion?"""
        return self.streak >= STAGE_PERSIST

    def in_doubt(self) -> bool:
        """Does the signal want the next steps' stage times whatever the sampling: a stage
        in excess, or baselines not yet learned over half a warm-up?"""
        return self.streak > 0 or self.seen < self.armed_after

    def learn(self, dev: np.ndarray) -> float:
        """A healthy step's deviation into the baselines; the rate it learned at (the
        shared level's baseline learns at the same)."""
        rate = max(self.drift, 1.0 / (self.seen + 1))
        self.base = self.base + rate * dev  # type: ignore[operator]
        spread = 1.4826 * float(np.median(np.abs(dev)))
        self.spread += rate * (spread - self.spread)
        self.seen += 1
        return rate

    def calm(self) -> None:
        """The probes cleared the suspicion: no run of excess stands any more."""
        self.streak = 0

    def reset(self) -> None:
        """A re-plan: learn each stage's share afresh (the spread is kept)."""
        self.streak, self.base, self.seen = 0, None, 0


class SharedLevel:
    """The stages' common level: a low quantile of their times against their healthy
    baselines (one slow stage does not move it), the part of a step's excess the whole
    machine shares: a load on the host slows every stage alike, and that is drift (without
    it, a load switched on raised an alarm the probes then cleared). Where the host's CPU
    counters are known it counts only while they show other processes taking cores: a slow
    device can lift every stage by itself (the stages wait on its transfers), and taken as
    load, a 1.2x device's 1.12x step slowdown was learned as drift in a full run of
    `benchmarks/detection.py` (corpus, seed 3) and never caught."""

    def __init__(self, warmup: int, k: float, min_excess: float) -> None:
        self.armed_after = warmup // 2  # steps its baseline learns before the level counts
        self.k, self.min_excess = k, min_excess
        self.base: np.ndarray | None = None  # healthy log(time / expected) per stage
        self.dev = np.zeros(0)  # this step's log(time / expected) against the baseline
        self.level = 0.0  # this step's machine-wide stage level against its baseline
        self.spread = 0.0  # robust sigma of `level` on healthy steps
        self.seen = 0  # steps its baseline learned
        self.explained = 0.0  # the part of this step's excess the level explains

    def measure(self, log_ratio: np.ndarray | None) -> None:
        """This step's level from its stages' log(time / expected) (0 without stage times);
        the first step (or a new shape) starts the baseline."""
        self.level = 0.0
        if log_ratio is None:
            return
        if self.base is None or self.base.shape != log_ratio.shape:
            self.base, self.seen = log_ratio, 0
        self.dev = log_ratio - self.base
        # the second-lowest of 4 stages (lowest of 2): one slow stage never lifts it
        self.level = float(np.sort(self.dev.ravel())[self.dev.size // 4])

    def explains(self, cpu_known: bool, host: float) -> float:
        """The part of this step's log excess the level explains (kept as `explained`); with
        the counters known (`cpu_known`), only while other processes take cores (`host` > 0)."""
        self.explained = self._standing_out() if not cpu_known or host > 0.0 else 0.0
        return self.explained

    def _standing_out(self) -> float:
        """The level when it stands out of its noise, else 0: a noisy level subtracted on
        every step would blunt the step signal on a quiet host. Once it stood out, half that
        suffices while it lasts: a load stays a while, and its level, measured on a few
        stages' single forwards, swings around it."""
        if self.seen < self.armed_after:
            return 0.0
        floor = max(self.min_excess, self.k * self.spread)
        return self.level if self.level > (floor / 2 if self.explained else floor) else 0.0

    def learn(self, rate: float) -> None:
        """A healthy step's stage times (those `measure` saw) into the baseline, at `rate`."""
        self.base = self.base + rate * self.dev  # type: ignore[operator]
        if not self.explained:  # noise only: a real shared slowdown would inflate it
            # mean |level| x 1.2533 is sigma for normal noise
            self.spread += rate * (1.2533 * abs(self.level) - self.spread)
        self.seen += 1

    def reset(self) -> None:
        """A re-plan: learn the baseline and its noise afresh."""
        self.base, self.spread, self.explained, self.seen = None, 0.0, 0.0, 0


class CpuAccounting:
    """The host's CPU accounting (`StepObservation.host_cpu`), where it comes with the steps.

    Other processes running on more cores than on healthy steps explain part of an excess
    (`host_level`): drift, known the very step a load switches on, where the stages' shared
    level needs several steps to stand out of its noise (each switch-on otherwise cost a
    probe). A slow device does not raise the others' use by itself; on a saturated host they
    take what it leaves idle, so a fault under a load shows partly as host load, and the stage
    shares (which no load moves) still see it.

    Where the process keeps the host's cores busy (a CPU-bound step, as 8 fake devices on 2
    cores), the counters tell a slow device from a slow machine (`own_level`): a slow device
    leaves cores idle while the others wait for it (`benchmarks/detection.py --data
    synthetic:bimodal --seed 6`: a 1.2x device's steps at 0.91-0.96x the cores, a 2x device's
    at 0.64-0.71x), while slower cores (the machine's own swings, which raised both false
    alarms of a full `--data synthetic:lognormal --seed 12` run: steps 6% to 16% slower over
    4-5 steps at the healthy cores, nothing else running) burn more CPU seconds for the same
    batch. Not with several processes (one host's slower cores are a slow device of the job),
    nor under OWN_BOUND of the cores (on a GPU host a thread spin-waiting on a slow GPU would
    burn CPU in step with the wall time)."""

    def __init__(self, warmup: int) -> None:
        self.armed_after = warmup // 2  # steps of healthy use learned before it counts
        self.base: tuple[float, float] | None = None  # healthy (own, others) cores
        self.seen = 0

    def known(self, cpu: HostCpu | None) -> bool:
        """Are the host's counters here, with a healthy level learned over half a warm-up?"""
        return cpu is not None and self.base is not None and self.seen >= self.armed_after

    def host_level(self, cpu: HostCpu | None) -> float:
        """The log slowdown other processes explain: this process got min(own, cores -
        others) cores against the same at their healthy level (`own`: its healthy use); 0
        within HOST_MIN_CORES of it (tick noise) or where the host has cores to spare."""
        if not self.known(cpu):
            return 0.0
        own, others = self.base
        if cpu.others - others < HOST_MIN_CORES:
            return 0.0
        least = 0.05 * cpu.cores  # a host taken whole still leaves us a little
        healthy = max(least, min(own, cpu.cores - others))
        now = max(least, min(own, cpu.cores - cpu.others))
        return max(0.0, math.log(healthy / now))

    def own_level(self, cpu: HostCpu | None, excess: float, margin: float) -> float:
        """The part of a step's log `excess` this process's extra CPU seconds explain: excess
        + log(its cores now / healthy), >= 0, at most `margin` (the stated margin); 0 where
        the class docstring says the counters cannot tell, or where its cores fell."""
        if not self.known(cpu) or not cpu.every_device:
            return 0.0
        own, others = self.base
        if own < OWN_BOUND * (cpu.cores - others) or own <= 0:
            return 0.0
        if cpu.own < own - HOST_MIN_CORES:
            return 0.0  # cores left idle: a device keeps the others waiting
        explained = max(0.0, excess + math.log(max(cpu.own, 1e-3 * own) / own))
        # Up to the stated margin only. Devices sharing cores keep them busy while a slow one
        # sleeps (a `resihp demo` run missed its 3x device altogether: the process's cores
        # fell far less than its steps lengthened), so past the margin the step is a
        # device's to check, and the probe tells which (a slower machine: none).
        return min(explained, margin)

    def learn(self, cpu: HostCpu | None, rate: float) -> None:
        """A healthy step's counters into the healthy level, at `rate` or faster while few
        are learned."""
        if cpu is None:
            return
        if self.base is None:
            self.base, self.seen = (cpu.own, cpu.others), 0
        rate = max(rate, 1.0 / (self.seen + 1))
        own, others = self.base
        self.base = (own + rate * (cpu.own - own), others + rate * (cpu.others - others))
        self.seen += 1

    def reset(self) -> None:
        """A re-plan: the new plan uses the cores its own way."""
        self.base, self.seen = None, 0


def _sorted_quantile(sorted_N: np.ndarray, q: float) -> float:
    """np.quantile's (linear) `q` quantile of an already sorted array."""
    at = q * (len(sorted_N) - 1)
    lo = int(math.floor(at))
    hi = min(lo + 1, len(sorted_N) - 1)
    return float(sorted_N[lo] + (sorted_N[hi] - sorted_N[lo]) * (at - lo))
