"""Document-length distributions and the length statistics the benchmarks report (attention
cost grows with the sum of squared lengths, so their spread decides how step times swing).
"""

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from resihp_jax.errors import ConfigError

MIN_DOC_LEN = 8
UNIFORM_MIN_LEN = 16
LOGNORMAL_SIGMA = 1.0
BIMODAL_SHORT_PROB = 0.75

LengthSampler = Callable[[np.random.Generator, int], int]


def _clip(length: float, seq_len: int) -> int:
    hi = 4 * seq_len
    return int(np.clip(round(length), min(MIN_DOC_LEN, hi), hi))


def _uniform(rng: np.random.Generator, seq_len: int) -> int:
    lo = min(UNIFORM_MIN_LEN, seq_len)
    return int(rng.integers(lo, seq_len, endpoint=True))


def _lognormal(rng: np.random.Generator, seq_len: int) -> int:
    median = seq_len / 4
    return _clip(rng.lognormal(np.log(median), LOGNORMAL_SIGMA), seq_len)


def _bimodal(rng: np.random.Generator, seq_len: int) -> int:
    if rng.random() < BIMODAL_SHORT_PROB:
        return _clip(rng.integers(MIN_DOC_LEN, max(MIN_DOC_LEN, seq_len // 8), endpoint=True),
                     seq_len)
    return _clip(rng.integers(max(1, seq_len // 2), 2 * seq_len, endpoint=True), seq_len)


DISTRIBUTIONS: dict[str, LengthSampler] = {"uniform": _uniform, "lognormal": _lognormal,
                                            "bimodal": _bimodal}


def get_distribution(name: str) -> LengthSampler:
    """The length sampler called `name`, or ConfigError listing the valid names."""
    if name not in DISTRIBUTIONS:
        raise ConfigError(f"unknown length distribution {name!r}; valid: "
                          f"{', '.join(sorted(DISTRIBUTIONS))}")
    return DISTRIBUTIONS[name]


def sum_sq(lengths: Iterable[int]) -> float:
    """Sum of l_i^2: the attention-cost term of a set of pieces."""
    return float(sum(float(n) ** 2 for n in lengths))


def coefficient_of_variation(values: Sequence[float] | np.ndarray) -> float:
    """Population std / mean; 0 for an empty or all-zero input."""
    values_N = np.asarray(values, dtype=np.float64)
    if values_N.size == 0 or values_N.mean() == 0:
        return 0.0
    return float(values_N.std() / values_N.mean())


def sum_sq_cv(sum_sq_per_microbatch: Iterable[np.ndarray]) -> float:
    """CV of per-micro-batch sum l_i^2 over many global batches (pass `b.sum_sq_lengths()`)."""
    chunks = [np.asarray(x, dtype=np.float64).ravel() for x in sum_sq_per_microbatch]
    return coefficient_of_variation(np.concatenate(chunks) if chunks else np.zeros(0))


def length_summary(lengths: Sequence[int] | np.ndarray) -> dict[str, float]:
    """Mean, median, p99, max and CV of a set of lengths, for benchmark tables."""
    lengths_N = np.asarray(lengths, dtype=np.float64)
    if lengths_N.size == 0:
        return {"n": 0, "mean": 0.0, "median": 0.0, "p99": 0.0, "max": 0.0, "cv": 0.0}
    return {"n": int(lengths_N.size), "mean": float(lengths_N.mean()),
            "median": float(np.median(lengths_N)), "p99": float(np.percentile(lengths_N, 99)),
            "max": float(lengths_N.max()), "cv": coefficient_of_variation(lengths_N)}
