"""A local text corpus as a document source: every text file under a directory, byte-level.

Only paths and sizes are indexed up front (sorted relative paths, so the order is the same on
every machine); a file is read when its turn comes. Each epoch visits the files in a fresh
seeded order. Binary or unreadable files are skipped when met; hidden entries are ignored.
"""

import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from resihp_jax.errors import ConfigError

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
BINARY_SNIFF_BYTES = 8192


def default_corpus_dir() -> str:
    """The Python standard library's source directory (installed packages are excluded)."""
    return sysconfig.get_paths()["stdlib"]


@dataclass(frozen=True)
class CorpusFile:
    rel_path: str
    size: int


def _wanted(name: str, suffixes: tuple[str, ...] | None) -> bool:
    return not name.startswith(".") and (suffixes is None or name.endswith(suffixes))


def index_files(root: Path, suffixes: tuple[str, ...] | None = None) -> tuple[CorpusFile, ...]:
    """Non-empty files under `root` (recursively, no hidden entries), by sorted relative path."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in EXCLUDED_DIRS]
        for name in filenames:
            path = Path(dirpath, name)
            if not _wanted(name, suffixes) or not path.is_file():
                continue
            size = path.stat().st_size
            if size > 0:
                found.append(CorpusFile(path.relative_to(root).as_posix(), size))
    return tuple(sorted(found, key=lambda f: f.rel_path))


def read_text_tokens(path: Path) -> np.ndarray | None:
    """Bytes of a UTF-8 text file as int32 tokens; None if unreadable, binary or empty."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if not data or b"\0" in data[:BINARY_SNIFF_BYTES]:
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)


class CorpusSource:
    """Files of a directory as documents, reshuffled every epoch with the seed."""

    def __init__(
        self,
        root: str | os.PathLike,
        seed: int,
        *,
        suffixes: tuple[str, ...] | None = None,
        max_doc_len: int | None = None,
        spec: str | None = None,
    ) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise ConfigError(
                f"corpus directory {str(root)!r} does not exist or is not a directory"
            )
        if max_doc_len is not None and max_doc_len <= 0:
            raise ConfigError(f"max_doc_len must be a positive int or None, got {max_doc_len!r}")
        self.files = index_files(self.root, suffixes)
        self.seed = seed
        self.max_doc_len = max_doc_len
        self.spec = spec if spec is not None else f"corpus:{root}"
        self._orders: dict[int, np.ndarray] = {}
        self._fingerprint = _fingerprint(self.files)
        self._require_a_usable_file(suffixes)

    def _require_a_usable_file(self, suffixes: tuple[str, ...] | None) -> None:
        # Reads files only until the first usable one, which is normally the first file.
        if not any(read_text_tokens(self.root / f.rel_path) is not None for f in self.files):
            kind = f"{'/'.join(suffixes)} " if suffixes else ""
            raise ConfigError(
                f"corpus directory {str(self.root)!r} has no usable {kind}text files "
                f"({len(self.files)} non-empty files found, all binary or unreadable); "
                "give a directory containing UTF-8 text files"
            )

    def items_per_epoch(self) -> int:
        return len(self.files)

    def order(self, epoch: int) -> np.ndarray:
        """File indices in the order epoch `epoch` visits them."""
        if epoch not in self._orders:
            self._orders = {
                epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.files))
            }
        return self._orders[epoch]

    def item(self, epoch: int, index: int) -> np.ndarray | None:
        return read_text_tokens(self.root / self.files[self.order(epoch)[index]].rel_path)

    def fingerprint(self) -> str:
        return self._fingerprint


def _fingerprint(files: tuple[CorpusFile, ...]) -> str:
    listing = "\n".join(f"{f.rel_path}\t{f.size}" for f in files)
    return f"{len(files)}:{zlib.crc32(listing.encode()):08x}"
