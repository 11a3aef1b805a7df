"""Failure traces: fail-stop arrivals, replacements, fail-slow episodes, seeded.

Numbers and where they come from:
- llama3: fail-stops at Llama 3's per-GPU rate, 419 unexpected interruptions in 54 days on
  16,384 GPUs (1.97e-5 per GPU-hour: 0.85 a week at 256 GPUs, 331 at 100,000).
- harsh: one fail-stop every 30 minutes whatever the size, as ResiHP evaluates.
- failslow: one fail-slow episode every 30 minutes (ResiHP's harsh cadence), no fail-stops.
- mixed: Llama 3 fail-stops plus fail-slow episodes every 30 minutes.
Fail-slow episodes: half compute, half network (FALCON sees both kinds), slowdowns
log-uniform in 1.1-5x, lasting exponentially 10 (compute) or 24 (network) minutes on average
(Greyhound/FALCON). A failed GPU is replaced after an exponential time of mean `replace_s`
(10 minutes: FT-HSDP's synchronous restart at O(100K) GPUs, a spare swapped in). Arrivals are
Poisson. Step-time noise (CV 17%) enters through the detectors' figures, measured under it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from resihp_jax.errors import ConfigError

LLAMA3_PER_GPU_HOUR = 419 / (54 * 24 * 16_384)
SCENARIOS = ("llama3", "harsh", "failslow", "mixed")
COMPUTE, NETWORK = 0, 1


@dataclass(frozen=True)
class Scenario:
    name: str
    stop_per_gpu_hour: float = 0.0  # fail-stops scale with the cluster...
    stop_interval_s: float | None = None  # ...or arrive at a fixed cadence
    slow_interval_s: float | None = None  # fail-slow episodes, cluster-wide cadence
    compute_share: float = 0.5
    slow_factor_range: tuple[float, float] = (1.1, 5.0)
    compute_mean_s: float = 600.0
    network_mean_s: float = 1440.0
    replace_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("stop_per_gpu_hour", "compute_mean_s", "network_mean_s", "replace_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"Scenario.{name}={getattr(self, name)!r}: must be >= 0")
        for name in ("stop_interval_s", "slow_interval_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"Scenario.{name}={value!r}: must be > 0 or None")
        lo, hi = self.slow_factor_range
        if not 1.0 < lo <= hi:
            raise ConfigError(f"Scenario.slow_factor_range={self.slow_factor_range}: need "
                              "1 < low <= high")

    def stop_rate_per_s(self, n_gpus: int) -> float:
        if self.stop_interval_s is not None:
            return 1.0 / self.stop_interval_s
        return self.stop_per_gpu_hour * n_gpus / 3600.0


def get_scenario(name: str) -> Scenario:
    table = {
        "llama3": Scenario("llama3", stop_per_gpu_hour=LLAMA3_PER_GPU_HOUR),
        "harsh": Scenario("harsh", stop_interval_s=1800.0),
        "failslow": Scenario("failslow", slow_interval_s=1800.0),
        "mixed": Scenario("mixed", stop_per_gpu_hour=LLAMA3_PER_GPU_HOUR,
                          slow_interval_s=1800.0),
    }
    if name not in table:
        raise ConfigError(f"unknown scenario {name!r}; valid: {', '.join(SCENARIOS)}")
    return table[name]


@dataclass(frozen=True)
class Trace:
    """Events of one seeded run; times in seconds from the start."""

    duration_s: float
    n_gpus: int
    stop_t_F: np.ndarray  # fail-stop times, sorted
    stop_dev_F: np.ndarray
    replace_t_F: np.ndarray  # when each failed GPU's replacement is available
    slow_t_E: np.ndarray  # fail-slow episode starts, sorted
    slow_end_E: np.ndarray
    slow_dev_E: np.ndarray
    slow_factor_E: np.ndarray  # >= 1: how many times slower
    slow_kind_E: np.ndarray  # COMPUTE or NETWORK

    @property
    def n_stops(self) -> int:
        return int(self.stop_t_F.size)


def _arrivals(rate_per_s: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    n = rng.poisson(rate_per_s * duration_s)
    return np.sort(rng.uniform(0.0, duration_s, size=n))


def make_trace(scenario: Scenario, n_gpus: int, duration_s: float, seed: int) -> Trace:
    """One run's failures; the same (scenario, size, duration, seed) gives the same trace."""
    if n_gpus < 1 or not duration_s > 0:
        raise ConfigError(f"make_trace: n_gpus={n_gpus} must be >= 1 and duration_s="
                          f"{duration_s} > 0")
    rng = np.random.default_rng(seed)
    stop_t = _arrivals(scenario.stop_rate_per_s(n_gpus), duration_s, rng)
    stop_dev = rng.integers(0, n_gpus, size=stop_t.size)
    replace_t = stop_t + rng.exponential(scenario.replace_s, size=stop_t.size)
    rate = 0.0 if scenario.slow_interval_s is None else 1.0 / scenario.slow_interval_s
    slow_t = _arrivals(rate, duration_s, rng)
    kind = (rng.random(slow_t.size) >= scenario.compute_share).astype(np.int64)
    lo, hi = scenario.slow_factor_range
    factor = np.exp(rng.uniform(np.log(lo), np.log(hi), size=slow_t.size))
    mean_s = np.where(kind == COMPUTE, scenario.compute_mean_s, scenario.network_mean_s)
    slow_end = slow_t + rng.exponential(1.0, size=slow_t.size) * mean_s
    slow_dev = rng.integers(0, n_gpus, size=slow_t.size)
    return Trace(duration_s, n_gpus, stop_t, stop_dev, replace_t, slow_t, slow_end, slow_dev,
                 factor, kind)
