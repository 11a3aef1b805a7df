"""A local text corpus as a document source: every text file under a directory, byte-level.

The index holds sorted relative paths and sizes (the same order on every machine) of text
files only (git's rule: no NUL byte, valid UTF-8 in the first 8 KiB); a file is read when a
micro-batch on this host needs it. Each epoch visits the files in a fresh seeded order.
"""

import codecs
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


def looks_like_text(path: Path) -> bool:
    """Readable, and its first 8 KiB hold no NUL byte and decode as (the start of) UTF-8."""
    try:
        with path.open("rb") as f:
            head = f.read(BINARY_SNIFF_BYTES)
    except OSError:
        return False
    if b"\0" in head:
        return False
    try:  # a multi-byte character cut at the sniff's end is fine
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


def index_files(root: Path, suffixes: tuple[str, ...] | None = None) -> tuple[CorpusFile, ...]:
    """Non-empty files under `root` (recursively, no hidden entries), by sorted relative path."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in EXCLUDED_DIRS]
        for name in filenames:
            path = Path(dirpath, name)
            wanted = suffixes is None or name.endswith(suffixes)
            if name.startswith(".") or not wanted or not path.is_file():
                continue
            size = path.stat().st_size
            if size > 0:
                found.append(CorpusFile(path.relative_to(root).as_posix(), size))
    return tuple(sorted(found, key=lambda f: f.rel_path))


class CorpusSource:
    """Files of a directory as documents, reshuffled every epoch with the seed."""

    def __init__(self, root: str | os.PathLike, seed: int, *,
                 suffixes: tuple[str, ...] | None = None, max_doc_len: int | None = None,
                 spec: str | None = None) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise ConfigError(f"corpus directory {str(root)!r} does not exist or is not a "
                              "directory")
        if max_doc_len is not None and max_doc_len <= 0:
            raise ConfigError(f"max_doc_len must be a positive int or None, got {max_doc_len!r}")
        found = index_files(self.root, suffixes)
        self.files = tuple(f for f in found if looks_like_text(self.root / f.rel_path))
        self.seed = seed
        self.max_doc_len = max_doc_len
        self.spec = spec if spec is not None else f"corpus:{root}"
        self._orders: dict[int, np.ndarray] = {}
        self._fingerprint = _fingerprint(self.files)
        if not self.files:
            kind = f"{'/'.join(suffixes)} " if suffixes else ""
            raise ConfigError(f"corpus directory {str(self.root)!r} has no usable {kind}text "
                              f"files ({len(found)} non-empty files found, all binary or "
                              "unreadable); give a directory containing UTF-8 text files")

    def items_per_epoch(self) -> int:
        return len(self.files)

    def order(self, epoch: int) -> np.ndarray:
        """File indices in the order epoch `epoch` visits them."""
        if epoch not in self._orders:
            rng = np.random.default_rng([self.seed, epoch])
            self._orders = {epoch: rng.permutation(len(self.files))}
        return self._orders[epoch]

    def file(self, epoch: int, index: int) -> CorpusFile:
        return self.files[self.order(epoch)[index]]

    def item_size(self, epoch: int, index: int) -> int:
        return self.file(epoch, index).size

    def item(self, epoch: int, index: int) -> np.ndarray:
        indexed = self.file(epoch, index)
        path = self.root / indexed.rel_path
        try:
            tokens = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int32)
        except OSError:
            tokens = None
        if tokens is None or tokens.size != indexed.size:
            now = "cannot be read" if tokens is None else f"has {tokens.size} bytes"
            raise ConfigError(
                f"corpus file {str(path)!r} {now}, but was indexed with {indexed.size} bytes; "
                "the corpus must not change while a job runs")
        return tokens

    def fingerprint(self) -> str:
        return self._fingerprint


def _fingerprint(files: tuple[CorpusFile, ...]) -> str:
    listing = "\n".join(f"{f.rel_path}\t{f.size}" for f in files)
    return f"{len(files)}:{zlib.crc32(listing.encode()):08x}"
