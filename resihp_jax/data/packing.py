"""Packing documents into fixed rows of tokens, segment ids and positions; the global batch.

Rows are filled greedily: documents sit contiguously, and one longer than the space left
continues in the next row as a new segment, so only the last rows of a finite source pad.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from resihp_jax.data.lengths import sum_sq
from resihp_jax.errors import ConfigError

# take(n) returns the next piece of at most n > 0 tokens, or an empty array when exhausted.
Take = Callable[[int], np.ndarray]


def fill_row(take: Take, seq_len: int) -> list[np.ndarray]:
    """Pieces for one row of `seq_len` tokens; fewer tokens only if the stream ran out."""
    pieces: list[np.ndarray] = []
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


def pack_rows(pieces_per_row: Sequence[Sequence[np.ndarray]], seq_len: int) -> PackedRows:
    """Lay pieces out row by row: segment ids 1, 2, ... per row, positions restart per piece."""
    shape = (len(pieces_per_row), seq_len)
    tokens_NxS = np.zeros(shape, np.int32)
    segment_ids_NxS = np.zeros(shape, np.int32)
    positions_NxS = np.zeros(shape, np.int32)
    for row, pieces in enumerate(pieces_per_row):
        start = 0
        for segment, piece in enumerate(pieces, start=1):
            end = start + piece.size
            tokens_NxS[row, start:end] = piece
            segment_ids_NxS[row, start:end] = segment
            positions_NxS[row, start:end] = np.arange(piece.size, dtype=np.int32)
            start = end
    doc_lengths = tuple(tuple(int(p.size) for p in pieces) for pieces in pieces_per_row)
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


@dataclass(frozen=True, eq=False)
class GlobalBatch:
    """The micro-batches one training step consumes, plus each row's piece lengths."""

    tokens_MxBxS: np.ndarray
    segment_ids_MxBxS: np.ndarray
    positions_MxBxS: np.ndarray
    doc_lengths: tuple[tuple[tuple[int, ...], ...], ...]

    @classmethod
    def from_rows(cls, rows: PackedRows, n_microbatches: int) -> "GlobalBatch":
        """Split N = M * B packed rows into M consecutive micro-batches of B rows."""
        n_rows, seq_len = rows.tokens_NxS.shape
        if n_microbatches <= 0 or n_rows % n_microbatches:
            raise ConfigError(
                f"cannot split {n_rows} rows into n_microbatches={n_microbatches}; "
                "it must be a positive divisor of the row count"
            )
        b = n_rows // n_microbatches
        shape = (n_microbatches, b, seq_len)
        lengths = tuple(rows.doc_lengths[m * b : (m + 1) * b] for m in range(n_microbatches))
        return cls(
            rows.tokens_NxS.reshape(shape),
            rows.segment_ids_NxS.reshape(shape),
            rows.positions_NxS.reshape(shape),
            lengths,
        )

    @property
    def shape(self) -> tuple[int, int, int]:
        """(n_microbatches, microbatch_size, seq_len)."""
        return tuple(self.tokens_MxBxS.shape)

    def sum_sq_lengths(self) -> np.ndarray:
        """float64 [M]: sum of l_i^2 over each micro-batch's pieces."""
        return np.array(
            [sum_sq(n for row in mb for n in row) for mb in self.doc_lengths], dtype=np.float64
        )

    def loss_mask_MxBxS(self) -> np.ndarray:
        """True where a token has a next token in the same segment (never the last column)."""
        seg_MxBxS = self.segment_ids_MxBxS
        mask_MxBxS = np.zeros(seg_MxBxS.shape, dtype=bool)
        seg_now, seg_next = seg_MxBxS[..., :-1], seg_MxBxS[..., 1:]
        mask_MxBxS[..., :-1] = (seg_now != 0) & (seg_next == seg_now)
        return mask_MxBxS

    def loss_tokens_per_microbatch(self) -> np.ndarray:
        """int64 [M]: loss tokens per micro-batch, for token-weighted gradient averaging."""
        return self.loss_mask_MxBxS().sum(axis=(1, 2), dtype=np.int64)

    def n_loss_tokens(self) -> int:
        """Tokens the train loss counts: seg[i] != 0 and seg[i+1] == seg[i]."""
        return int(self.loss_mask_MxBxS().sum())
