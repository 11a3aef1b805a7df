"""Our own measured figures the simulator takes as inputs, each with the command that produces
it, and the terms that grow with scale (modelled, not measured here) with their numbers.

Recovery figures are PROVISIONAL until `benchmarks/recovery.py` lands (its JSON line will be
`{"recovery_s": {"split_only": ..., "mesh_cold": ..., "mesh_warm": ...}, ...}`); the values
below are its targets (split_only <= 0.5 s, mesh_warm <= 2 s). Update them from its output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DetectorFigures:
    """How a detector behaves on real step timings (step-time CV about 17% from variable
    sequence lengths): who it catches, how fast, and how often it cries wolf."""

    delay_steps: float  # steps from onset to verdict, for slowdowns it detects reliably
    reliable_factor: float  # slowdowns >= this are detected every time
    partial_factor: float  # slowdowns in [partial, reliable) are detected half the time
    false_alarms: int  # alarms on `healthy_steps` healthy steps; each stalls for a probe
    healthy_steps: int = 500

    @property
    def false_alarms_per_step(self) -> float:
        return self.false_alarms / self.healthy_steps


# `python benchmarks/detection.py` (full run): ours detects 1.5x-5x slowdowns a median of 2
# steps after onset (1.2x half the time); 0 false alarms in 500 healthy steps; Greyhound-style
# change points 47 false alarms, median+MAD 2. The baselines' delays and reach are from
# `python benchmarks/detection.py --quick` (one trial per factor): Greyhound-style caught
# 1.2x-5x after 1-2 steps (median 2); median+MAD missed 1.2x and 1.5x, caught 2x and 5x after
# 2 and 1 steps (modelled: 1.5 steps, 2x reliably, 1.5x half the time).
DETECTORS = {
    "resihp": DetectorFigures(2.0, 1.5, 1.2, 0),
    "greyhound": DetectorFigures(2.0, 1.2, 1.1, 47),
    "mad": DetectorFigures(1.5, 2.0, 1.5, 2),
}

# `python benchmarks/recovery.py` (PROVISIONAL: targets until its JSON is in): seconds from a
# fail-slow verdict to the next step, in process, 8 fake devices.
RECOVERY_S = {"split_only": 0.5, "mesh_warm": 2.0, "mesh_cold": 60.0}

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
    - compile: executable loaded from the warm persistent cache, 20 s for a 70B program;
    - the step in flight is lost: half a step on average.
    """

    detect_s: float = 10.0
    relaunch_s: float = 15.0
    fanout_s_per_host: float = 2e-3
    init_s: float = 10.0
    init_s_per_host: float = 1e-3
    restore_bytes_per_s: float = 10e9
    state_bytes_per_param: float = 16.0
    compile_warm_s: float = 20.0
    gpus_per_host: int = 8

    def seconds(self, n_gpus: int, params_per_device: float, step_s: float) -> float:
        hosts = math.ceil(n_gpus / self.gpus_per_host)
        restore = params_per_device * self.state_bytes_per_param / self.restore_bytes_per_s
        return (self.detect_s + 0.5 * step_s + self.relaunch_s
                + self.fanout_s_per_host * hosts + self.init_s + self.init_s_per_host * hosts
                + restore + self.compile_warm_s + planning_s(n_gpus))


OUR_RESTART = RestartCosts()
