"""Packing documents into fixed rows of tokens, segment ids and positions; the global batch.

Rows are filled greedily (a document longer than the space left continues in the next row),
and a layout depends only on lengths, so a `GlobalBatch` reads a micro-batch's tokens only
when asked: each host of a multi-host job reads only its own micro-batches.
"""

import functools
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from resihp_jax.data.lengths import sum_sq
from resihp_jax.errors import ConfigError


class Sized(Protocol):
    """A piece of a document: its tokens (np.ndarray) or a description of where they are."""

    @property
    def size(self) -> int: ...


# take(n) returns the next piece of at most n > 0 tokens, or an empty piece when exhausted.
Take = Callable[[int], Sized]


def fill_row(take: Take, seq_len: int) -> list[Sized]:
    """Pieces for one row of `seq_len` tokens; fewer tokens only if the stream ran out."""
    pieces: list[Sized] = []
    space = seq_len
    while space > 0:
        piece = take(space)
        if piece.size == 0:
            break
        pieces.append(piece)
        space -= piece.size
    return pieces


@dataclass(frozen=True, eq=False)
class PackedRows:
    tokens_NxS: np.ndarray
    segment_ids_NxS: np.ndarray
    positions_NxS: np.ndarray
    doc_lengths: tuple[tuple[int, ...], ...]


Lengths = tuple[tuple[int, ...], ...]  # per row, the lengths of its pieces


def layout_rows(lengths_per_row: Lengths, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(segment_ids [N, S], positions [N, S]) of rows holding pieces of these lengths:
    segment ids 1, 2, ... per row, positions restarting at 0 in every piece, 0 in padding."""
    shape = (len(lengths_per_row), seq_len)
    segment_ids_NxS = np.zeros(shape, np.int32)
    positions_NxS = np.zeros(shape, np.int32)
    for row, lengths in enumerate(lengths_per_row):
        start = 0
        for segment, n in enumerate(lengths, start=1):
            segment_ids_NxS[row, start:start + n] = segment
            positions_NxS[row, start:start + n] = np.arange(n, dtype=np.int32)
            start += n
    return segment_ids_NxS, positions_NxS


def row_tokens(pieces: Sequence[np.ndarray], seq_len: int) -> np.ndarray:
    """int32 [S]: the pieces' tokens side by side, zero padded."""
    tokens_T = np.concatenate([np.zeros(0, np.int32), *pieces]).astype(np.int32)
    return np.pad(tokens_T, (0, seq_len - tokens_T.size))


def pack_rows(pieces_per_row: Sequence[Sequence[np.ndarray]], seq_len: int) -> PackedRows:
    """Lay pieces out row by row: segment ids 1, 2, ... per row, positions restart per piece."""
    doc_lengths = tuple(tuple(int(p.size) for p in pieces) for pieces in pieces_per_row)
    segment_ids_NxS, positions_NxS = layout_rows(doc_lengths, seq_len)
    tokens_NxS = np.array([row_tokens(pieces, seq_len) for pieces in pieces_per_row],
                          np.int32).reshape(-1, seq_len)
    return PackedRows(tokens_NxS, segment_ids_NxS, positions_NxS, doc_lengths)


class _ListReader:
    """take() over a finite list of documents, skipping empty ones."""

    def __init__(self, docs: Iterable[np.ndarray]) -> None:
        self._docs = [np.asarray(d, dtype=np.int32).ravel() for d in docs]
        self._docs = [d for d in self._docs if d.size > 0]
        self._index = 0
        self._offset = 0

    def take(self, n: int) -> np.ndarray:
        if self._index == len(self._docs):
            return np.zeros(0, np.int32)
        doc = self._docs[self._index]
        piece = doc[self._offset : self._offset + n]
        self._offset += piece.size
        if self._offset == doc.size:
            self._index, self._offset = self._index + 1, 0
        return piece


def pack_documents(docs: Iterable[np.ndarray], seq_len: int) -> PackedRows:
    """Pack a finite list of documents into as many rows as needed; the last row may pad."""
    reader = _ListReader(docs)
    rows = []
    while pieces := fill_row(reader.take, seq_len):
        rows.append(pieces)
    return pack_rows(rows, seq_len)


# m -> int32 [B, S]: the tokens of micro-batch m, read when asked
ReadMicrobatch = Callable[[int], np.ndarray]


def _check_split(n_rows: int, n_microbatches: int) -> int:
    """Rows per micro-batch; ConfigError unless n_microbatches divides n_rows."""
    if n_microbatches <= 0 or n_rows % n_microbatches:
        raise ConfigError(f"cannot split {n_rows} rows into n_microbatches={n_microbatches}; "
                          "it must be a positive divisor of the row count")
    return n_rows // n_microbatches


@dataclass(frozen=True, eq=False)
class GlobalBatch:
    """The micro-batches one training step consumes: their layout (segment ids, positions,
    each row's piece lengths) and a reader of their tokens, called per micro-batch.

    `content_crc` names the content without reading it: two batches with equal CRCs trained
    on the same tokens (it is what a step record keeps to show no batch was skipped or
    repeated)."""

    segment_ids_MxBxS: np.ndarray
    positions_MxBxS: np.ndarray
    doc_lengths: tuple[Lengths, ...]
    read_microbatch: ReadMicrobatch
    content_crc: int

    @classmethod
    def from_rows(cls, rows: PackedRows, n_microbatches: int) -> "GlobalBatch":
        """Split N = M * B packed rows into M consecutive micro-batches of B rows."""
        n_rows, seq_len = rows.tokens_NxS.shape
        b = _check_split(n_rows, n_microbatches)
        shape = (n_microbatches, b, seq_len)
        tokens_MxBxS = rows.tokens_NxS.reshape(shape)
        return cls(rows.segment_ids_NxS.reshape(shape), rows.positions_NxS.reshape(shape),
                   _split_lengths(rows.doc_lengths, n_microbatches, b),
                   lambda m: tokens_MxBxS[m],
                   zlib.crc32(np.ascontiguousarray(tokens_MxBxS).tobytes()))

    @classmethod
    def from_layout(cls, doc_lengths: Lengths, n_microbatches: int, seq_len: int,
                    read_microbatch: ReadMicrobatch, content_crc: int) -> "GlobalBatch":
        """A batch of rows with these piece lengths whose tokens `read_microbatch` reads."""
        b = _check_split(len(doc_lengths), n_microbatches)
        shape = (n_microbatches, b, seq_len)
        segment_ids_NxS, positions_NxS = layout_rows(doc_lengths, seq_len)
        return cls(segment_ids_NxS.reshape(shape), positions_NxS.reshape(shape),
                   _split_lengths(doc_lengths, n_microbatches, b), read_microbatch,
                   content_crc)

    def microbatch_tokens(self, m: int) -> np.ndarray:
        """int32 [B, S]: the tokens of micro-batch m (read now)."""
        return self.read_microbatch(m)

    def microbatches(self, first: int, count: int) -> "GlobalBatch":
        """Micro-batches [first, first + count): one replica's share of the batch (its
        tokens still read per micro-batch, its CRC the whole batch's)."""
        if not (0 <= first and count >= 1 and first + count <= self.shape[0]):
            raise ValueError(f"micro-batches [{first}, {first + count}) of a batch of "
                             f"{self.shape[0]}")
        part = slice(first, first + count)
        return GlobalBatch(self.segment_ids_MxBxS[part], self.positions_MxBxS[part],
                           self.doc_lengths[part], lambda m: self.read_microbatch(first + m),
                           self.content_crc)

    @functools.cached_property
    def tokens_MxBxS(self) -> np.ndarray:
        """All tokens (reads every micro-batch: one process, or tests)."""
        return np.stack([self.microbatch_tokens(m) for m in range(self.shape[0])])

    @property
    def shape(self) -> tuple[int, int, int]:
        """(n_microbatches, microbatch_size, seq_len)."""
        return tuple(self.segment_ids_MxBxS.shape)

    def sum_sq_lengths(self) -> np.ndarray:
        """float64 [M]: sum of l_i^2 over each micro-batch's pieces."""
        return np.array([sum_sq(n for row in mb for n in row) for mb in self.doc_lengths],
                        dtype=np.float64)


def _split_lengths(doc_lengths: Lengths, n_microbatches: int, b: int) -> tuple[Lengths, ...]:
    return tuple(doc_lengths[m * b:(m + 1) * b] for m in range(n_microbatches))
