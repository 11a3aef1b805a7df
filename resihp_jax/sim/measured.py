"""Our own measured figures the simulator takes as inputs, each with the command that produces
it, and the terms that grow with scale (modelled, not measured here) with their numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# step slowdowns below this take the detectors longer to call (`benchmarks/detection.py`)
SMALL_STEP_EXCESS = 1.3


@dataclass(frozen=True)
class DetectorFigures:
    """How a detector behaves on real step timings (step-time CV about 17% from variable
    sequence lengths): which step slowdowns it catches, how fast, how often it cries wolf.

    Reach is in step-level slowdowns (observed step / its healthy prediction), as the
    simulator's slow GPU slows its synchronous step by its own factor; on the benchmark's 8
    devices sharing 2 cores, a device made f times slower slows the step by less (1.2x: about
    1.1x)."""

    delay_small: float  # median steps from onset to verdict, step slowdowns < 1.3x
    delay_large: float  # ... and >= 1.3x
    reliable: float  # step slowdowns >= this were detected every time (inf: none)
    partial: float  # ... below this never
    rate_between: float  # the share detected in [partial, reliable)
    false_alarms: int  # alarms on `healthy_steps` healthy steps; each stalls for a probe
    healthy_steps: int = 500

    @property
    def false_alarms_per_step(self) -> float:
        return self.false_alarms / self.healthy_steps

    def delay_steps(self, seen: float) -> float:
        return self.delay_small if seen < SMALL_STEP_EXCESS else self.delay_large


# `python benchmarks/detection.py` (full run: 2 plans, 250 healthy steps each, 3 trials of
# each device factor 1.2/1.5/2/5x per plan, step slowdowns 1.08-3.5x; its JSON gives
# `step_reach` per detector). Ours: every step slowdown from 1.17x caught, 3 of 4 in
# 1.08-1.17x, 0 false alarms. Greyhound-style change points: 42 false alarms, and blind for
# the 35 steps its window takes to refill after each, so it misses even 3.5x within a trial's
# 8 steps: 10 of 11 caught from 1.08x. Median+MAD: 2 false alarms, every one from 1.44x.
DETECTORS = {
    "resihp": DetectorFigures(3.0, 2.0, reliable=1.171, partial=1.077, rate_between=0.75,
                              false_alarms=0),
    "greyhound": DetectorFigures(2.0, 1.0, reliable=3.536, partial=1.079, rate_between=0.909,
                                 false_alarms=42),
    "mad": DetectorFigures(2.0, 1.0, reliable=1.44, partial=1.079, rate_between=0.545,
                           false_alarms=2),
}

# What an in-process switch stalls beyond the step it runs (`python benchmarks/recovery.py`,
# full run, `small` on 8 fake CPU devices): a new split of the same mesh, planning plus the
# state's move, 0.37 s. A new mesh's state move is modelled with the 70B state's size (see
# `ours.py`); its program is compiled on the spot (`RestartCosts.compile_s`): the background
# precompiler prepares 4 likely meshes, at cluster scale a small share of those a verdict
# can pick.
SPLIT_ONLY_SWITCH_S = 0.37

# `python benchmarks/replan_quality.py`: our planning time, cold caches, one slow plus one
# dead device: 0.15 s at 1,024 devices, 0.65 s at 16,384. Charged per re-plan, extrapolated
# as a power law through those two points.
PLANNING_S = {1024: 0.15, 16384: 0.65}


def planning_s(n_gpus: int) -> float:
    (n0, t0), (n1, t1) = sorted(PLANNING_S.items())
    exponent = math.log(t1 / t0) / math.log(n1 / n0)
    return t0 * (n_gpus / n0) ** exponent


@dataclass(frozen=True)
class RestartCosts:
    """A fail-stop ends our incarnation: every process exits and the job relaunches on the
    survivors. Modelled terms (not measured on this machine), with their numbers:
    - detection: the supervisor sees a process exit or miss its heartbeat (10 s, as every
      system here is charged); a hung step is cut by the runtime's step timeout instead;
    - relaunch: supervisor notices, starts processes, imports (15 s), plus a launcher fan-out
      of 2 ms per host (8 GPUs per host: 25 s at 100,000 GPUs);
    - init: `jax.distributed.initialize` and first communicators, 10 s + 1 ms per host;
    - restore: each device reads its state (16 bytes per parameter: bf16 weights, fp32
      master and Adam moments) from the survivors' host snapshot at 10 GB/s, 0 steps lost
      when dp >= 2 (the newest periodic checkpoint otherwise);
    - compile: the train step calls back into Python (stage timing, fault knobs), and JAX
      never persists such an executable, so every incarnation compiles it afresh: assumed
      60 s for a 70B step whose layers are scanned (not measured here: no 70B on this
      machine);
    - the step in flight is lost: half a step on average.
    """

    detect_s: float = 10.0
    relaunch_s: float = 15.0
    fanout_s_per_host: float = 2e-3
    init_s: float = 10.0
    init_s_per_host: float = 1e-3
    restore_bytes_per_s: float = 10e9
    state_bytes_per_param: float = 16.0
    compile_s: float = 60.0
    gpus_per_host: int = 8

    def seconds(self, n_gpus: int, params_per_device: float, step_s: float) -> float:
        hosts = math.ceil(n_gpus / self.gpus_per_host)
        restore = params_per_device * self.state_bytes_per_param / self.restore_bytes_per_s
        return (self.detect_s + 0.5 * step_s + self.relaunch_s
                + self.fanout_s_per_host * hosts + self.init_s + self.init_s_per_host * hosts
                + restore + self.compile_s + planning_s(n_gpus))


OUR_RESTART = RestartCosts()
