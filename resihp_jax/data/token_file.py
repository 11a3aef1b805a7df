"""Token files: documents of token ids in one flat binary file, read through a memory map.

Format (little-endian, one file): a 40-byte header -- magic `b"RHTOKv1\\0"`, then four
fields: u64 token width in bytes (2: uint16, used when every id < 65536; else 4: uint32),
u64 n_docs, u64 n_tokens, and the 8-byte content digest (the documents' fingerprint) --
then (n_docs + 1) u64 offsets, in tokens (document i is tokens[offsets[i]:offsets[i + 1]],
offsets[0] = 0, offsets[n_docs] = n_tokens), then the n_tokens ids. The file is exactly
40 + 8 (n_docs + 1) + width * n_tokens bytes. `TokenFileSource` maps the offsets and the
ids without reading them, so each process reads only the documents of its own micro-batches.
"""

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from resihp_jax.data.adapters import MAX_TOKEN_ID, checked_documents, documents_digest
from resihp_jax.errors import ConfigError

MAGIC = b"RHTOKv1\0"
HEADER = struct.Struct("<8sQQQ8s")  # magic, token width, n_docs, n_tokens, digest
OFFSET_DTYPE = np.dtype("<u8")
TOKEN_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
UINT16_LIMIT = 1 << 16


def token_width(docs: list[np.ndarray]) -> int:
    """Bytes per token id: 2 when every id fits uint16, else 4."""
    return 2 if max(int(doc_L.max(initial=0)) for doc_L in docs) < UINT16_LIMIT else 4


def file_size(width: int, n_docs: int, n_tokens: int) -> int:
    """Bytes of a token file with these header fields."""
    return HEADER.size + OFFSET_DTYPE.itemsize * (n_docs + 1) + width * n_tokens


def as_path(path: Any, what: str) -> Path:
    """`path` as a Path; ConfigError unless it is a str or os.PathLike."""
    if not isinstance(path, str | os.PathLike):
        raise ConfigError(f"{what} needs a file path (str or os.PathLike), got {path!r}")
    return Path(path)


def write_token_file(path: str | os.PathLike, docs: Any) -> Path:
    """Write a sequence of 1-D integer token arrays as a token file at `path` (replaced
    whole, never left half-written); returns the path."""
    path = as_path(path, "write_token_file")
    checked = checked_documents(docs, "write_token_file")
    offsets_D = np.concatenate([[0], np.cumsum([doc_L.size for doc_L in checked])])
    width = token_width(checked)
    header = HEADER.pack(MAGIC, width, len(checked), int(offsets_D[-1]),
                         bytes.fromhex(documents_digest(checked)))
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:  # written beside it, then renamed over it: readers never see a partial file
        with temporary.open("wb") as f:
            f.write(header)
            f.write(offsets_D.astype(OFFSET_DTYPE).tobytes())
            for doc_L in checked:
                f.write(doc_L.astype(TOKEN_DTYPES[width]).tobytes())
        os.replace(temporary, path)
    except OSError as err:
        temporary.unlink(missing_ok=True)
        raise ConfigError(f"cannot write token file {str(path)!r}: {err}") from None
    return path


def _read_header(path: Path) -> tuple[int, int, int, str]:
    """(width, n_docs, n_tokens, digest) of the token file at `path`, checked against its
    size; ConfigError naming the file otherwise."""
    name = repr(str(path))
    try:
        with path.open("rb") as f:
            head = f.read(HEADER.size)
        size = path.stat().st_size
    except OSError as err:
        raise ConfigError(f"cannot read token file {name}: {err.strerror or err}") from None
    if len(head) < HEADER.size or not head.startswith(MAGIC):
        raise ConfigError(f"{name} is not a token file: it does not start with the "
                          f"{HEADER.size}-byte header {MAGIC!r}...; write one with "
                          "write_token_file")
    _, width, n_docs, n_tokens, digest = HEADER.unpack(head)
    if width not in TOKEN_DTYPES:
        raise ConfigError(f"token file {name} has token width {width}; valid: 2 or 4 bytes")
    expected = file_size(width, n_docs, n_tokens)
    if size != expected:
        how = "is truncated" if size < expected else "has extra bytes"
        raise ConfigError(f"token file {name} {how}: {size} bytes, but its header "
                          f"({n_docs} documents, {n_tokens} tokens of {width} bytes) "
                          f"needs {expected}")
    if n_tokens == 0:
        raise ConfigError(f"token file {name} holds no tokens; it needs at least one")
    return width, n_docs, n_tokens, digest.hex()


class TokenFileSource:
    """A token file as a DocumentSource: item i of every epoch is document i, read from the
    memory map when a micro-batch needs it (see the module docstring for the format)."""

    max_doc_len: int | None = None

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = as_path(path, "TokenFileSource")
        self.spec = f"token_file:{self.path.name}"  # the content is checked by fingerprint
        width, self.n_documents, self.n_tokens, digest = _read_header(self.path)
        self.token_dtype = TOKEN_DTYPES[width]
        self._fingerprint = f"{self.n_documents}:{digest}"
        self._offsets_D = np.memmap(self.path, OFFSET_DTYPE, "r", offset=HEADER.size,
                                    shape=(self.n_documents + 1,))
        self._tokens_T = np.memmap(self.path, self.token_dtype, "r",
                                   offset=file_size(width, self.n_documents, 0),
                                   shape=(self.n_tokens,))
        if self._offsets_D[0] != 0 or self._offsets_D[-1] != self.n_tokens:
            raise self._damaged(f"its offsets run from {int(self._offsets_D[0])} to "
                                f"{int(self._offsets_D[-1])}, not 0 to {self.n_tokens}")

    def _damaged(self, why: str) -> ConfigError:
        return ConfigError(f"token file {str(self.path)!r} is damaged: {why}; "
                           "write it again with write_token_file")

    def _bounds(self, index: int) -> tuple[int, int]:
        # offsets are checked as they are read: checking all of them on open would read the
        # whole index on every process
        start, end = (int(x) for x in self._offsets_D[index:index + 2])
        if not 0 <= start <= end <= self.n_tokens:
            raise self._damaged(f"document {index} has offsets [{start}, {end}) outside "
                                f"its {self.n_tokens} tokens")
        return start, end

    def items_per_epoch(self) -> int:
        return self.n_documents

    def item_size(self, epoch: int, index: int) -> int:
        start, end = self._bounds(index)
        return end - start

    def item(self, epoch: int, index: int) -> np.ndarray:
        start, end = self._bounds(index)
        tokens_L = self._tokens_T[start:end]  # reads only this document's pages
        if tokens_L.size and int(tokens_L.max()) > MAX_TOKEN_ID:
            raise self._damaged(f"document {index} holds token id {int(tokens_L.max())} "
                                f"> {MAX_TOKEN_ID}")
        return tokens_L.astype(np.int32)

    def fingerprint(self) -> str:
        return self._fingerprint
