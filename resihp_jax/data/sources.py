"""Document sources: deterministic, seeded, random-access streams of byte-level documents,
whose *items* are addressed by (epoch, index), so resuming needs no data. An item longer
than the source's `max_doc_len` is read as several documents.
"""

from typing import Protocol

import numpy as np

from resihp_jax.data.corpus import CorpusSource, default_corpus_dir
from resihp_jax.data.lengths import DISTRIBUTIONS, get_distribution
from resihp_jax.errors import ConfigError

MOTIF_ALPHABET = (ord("a"), ord("z") + 1)
MOTIF_LEN_RANGE = (2, 16)
MOTIF_NOISE = 0.05


class DocumentSource(Protocol):
    """What the batch iterator needs from a source of documents."""

    spec: str
    max_doc_len: int | None

    def items_per_epoch(self) -> int | None:
        """Items in one epoch; None for an endless source (everything stays in epoch 0)."""
        ...

    def item_size(self, epoch: int, index: int) -> int:
        """Tokens in item `index` of `epoch`, known without reading it (0: skip the item).
        Batches are laid out from sizes alone, so hosts read only their own micro-batches."""
        ...

    def item(self, epoch: int, index: int) -> np.ndarray:
        """int32 tokens of item `index` of `epoch`: exactly item_size of them (ConfigError
        naming the item if it no longer has that many); never asked for a skipped item."""
        ...

    def fingerprint(self) -> str:
        """Short identity of the content, checked when a saved position is restored."""
        ...


def motif_tokens(rng: np.random.Generator, length: int) -> np.ndarray:
    """A random letter motif repeated to `length` with a little noise: learnable by copying."""
    lo, hi = MOTIF_ALPHABET
    motif_len = int(rng.integers(MOTIF_LEN_RANGE[0], MOTIF_LEN_RANGE[1], endpoint=True))
    tokens_L = np.resize(rng.integers(lo, hi, motif_len, dtype=np.int32), length)
    noisy_L = rng.random(length) < MOTIF_NOISE
    tokens_L[noisy_L] = rng.integers(lo, hi, int(noisy_L.sum()), dtype=np.int32)
    return tokens_L


class SyntheticSource:
    """Endless synthetic documents; document i is a pure function of (seed, i)."""

    max_doc_len: int | None = None

    def __init__(self, distribution: str, seed: int, seq_len: int) -> None:
        self._sample_length = get_distribution(distribution)
        self.spec = f"synthetic:{distribution}"
        self.seed = seed
        self.seq_len = seq_len

    def items_per_epoch(self) -> int | None:
        return None

    def item_size(self, epoch: int, index: int) -> int:
        """Length of document `index` without generating its tokens."""
        return self._sample_length(np.random.default_rng([self.seed, index]), self.seq_len)

    def item(self, epoch: int, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index])
        return motif_tokens(rng, self._sample_length(rng, self.seq_len))

    def fingerprint(self) -> str:
        return self.spec


def valid_specs() -> list[str]:
    """The source specs `make_source` accepts."""
    return [f"synthetic:{name}" for name in DISTRIBUTIONS] + ["corpus", "corpus:PATH"]


def make_source(spec: str, seed: int, seq_len: int) -> DocumentSource:
    """Parse a source spec such as `synthetic:lognormal`, `corpus` or `corpus:PATH`."""
    kind, _, arg = spec.partition(":")
    if kind == "synthetic" and arg in DISTRIBUTIONS:
        return SyntheticSource(arg, seed, seq_len)
    if kind == "corpus" and spec == "corpus":
        return CorpusSource(default_corpus_dir(), seed, suffixes=(".py",), spec=spec)
    if kind == "corpus" and arg:
        return CorpusSource(arg, seed, spec=spec)
    raise ConfigError(f"unknown data source spec {spec!r}; valid: {', '.join(valid_specs())}")
