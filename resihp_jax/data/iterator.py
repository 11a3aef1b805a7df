"""The resumable batch iterator: a document source -> packed global batches.

Its whole state is a position in the source (epoch, item, token offset), so a restore never
skips or repeats a token; a batch depends on the source, seed and batch shape, not the Plan.
"""

import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from resihp_jax.data.packing import GlobalBatch, fill_row, row_tokens
from resihp_jax.data.sources import DocumentSource, make_source
from resihp_jax.errors import ConfigError

STATE_VERSION = 1
_IDENTITY_KEYS = ("source", "seed", "n_microbatches", "microbatch_size", "seq_len", "fingerprint")
_POSITION_KEYS = ("epoch", "index", "offset", "batches")


@dataclass(frozen=True)
class Cursor:
    """Where the next token comes from: token `offset` of item `index` of `epoch`."""

    epoch: int = 0
    index: int = 0
    offset: int = 0


class Piece(NamedTuple):
    """Where a piece of a document is: tokens [start, start + size) of item `index` of
    `epoch`. Enough to lay a row out, and to read its tokens later on any host."""

    epoch: int
    index: int
    start: int
    size: int


class DocumentStream:
    """Walks a source item by item by their sizes; take(n) describes the next piece of the
    current document without reading it."""

    def __init__(self, source: DocumentSource, cursor: Cursor = Cursor()) -> None:
        self.source = source
        self.cursor = cursor
        self._size: int | None = None  # of the current item, once looked up

    def _next_item(self) -> None:
        epoch, index = self.cursor.epoch, self.cursor.index + 1
        if index == self.source.items_per_epoch():
            epoch, index = epoch + 1, 0
        self.cursor = Cursor(epoch, index, 0)
        self._size = None

    def _current_size(self) -> int:
        skipped = 0
        while self._size is None:
            size = self.source.item_size(self.cursor.epoch, self.cursor.index)
            if size > 0:
                self._size = size
                break
            skipped += 1
            if skipped > (self.source.items_per_epoch() or np.inf):
                raise ConfigError(f"data source {self.source.spec!r} has no usable documents left")
            self._next_item()
        return self._size

    def _document_end(self, size: int) -> int:
        max_len = self.source.max_doc_len
        if max_len is None:
            return size
        return min(size, (self.cursor.offset // max_len + 1) * max_len)

    def take(self, n: int) -> Piece:
        """Up to n tokens of the current document, never crossing a document boundary."""
        size = self._current_size()
        start = self.cursor.offset
        piece = Piece(self.cursor.epoch, self.cursor.index, start,
                      min(self._document_end(size), start + n) - start)
        if start + piece.size == size:
            self._next_item()
        else:
            self.cursor = replace(self.cursor, offset=start + piece.size)
        return piece

    def check_cursor(self, cursor: Cursor) -> None:
        """ConfigError unless `cursor` points inside this source's items."""
        n_items = self.source.items_per_epoch()
        if n_items is None and cursor.epoch != 0:
            raise ConfigError(f"data state epoch={cursor.epoch} must be 0 for an endless source")
        if n_items is not None and cursor.index >= n_items:
            raise ConfigError(f"data state index={cursor.index} is past the {n_items} items")
        if cursor.offset == 0:
            return
        size = self.source.item_size(cursor.epoch, cursor.index)
        if cursor.offset >= size:
            raise ConfigError(f"data state offset={cursor.offset} is outside item "
                              f"{cursor.index} of epoch {cursor.epoch}, which has {size} tokens")


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        kind = "a positive" if minimum == 1 else "a non-negative"
        raise ConfigError(f"{name} must be {kind} int, got {value!r}")
    return int(value)


_SOURCE_METHODS = ("items_per_epoch", "item_size", "item", "fingerprint")


def _as_source(source: str | DocumentSource, seed: int, seq_len: int) -> DocumentSource:
    """The source a spec names, or `source` itself if it is a DocumentSource object (such as
    from_documents(docs) or TokenFileSource(path))."""
    if isinstance(source, str):
        return make_source(source, seed, seq_len)
    lacking = [name for name in _SOURCE_METHODS if not callable(getattr(source, name, None))]
    lacking += [name for name in ("spec", "max_doc_len") if not hasattr(source, name)]
    if lacking:
        raise ConfigError(
            f"data source must be a spec string or a DocumentSource (from_documents, "
            f"TokenFileSource, from_hf_dataset, ...); {type(source).__name__} lacks "
            f"{', '.join(lacking)} (for batches packed by hand use packed_batches)")
    return source


class _ResumableBatches:
    """What both batch iterators share: the batch shape, iteration, the count of batches
    served, and a state (the identity of the data and the position of the next batch) that
    `restore` continues from. A subclass says how its data is named and positioned."""

    seed: int | None

    def __init__(self, n_microbatches: int, microbatch_size: int, seq_len: int) -> None:
        self.n_microbatches = _check_int("n_microbatches", n_microbatches)
        self.microbatch_size = _check_int("microbatch_size", microbatch_size)
        self.seq_len = _check_int("seq_len", seq_len)
        self._batches = 0

    def next_batch(self) -> GlobalBatch:
        raise NotImplementedError

    def _source(self) -> tuple[str, str]:
        """(the source's spec, its fingerprint): what the data is."""
        raise NotImplementedError

    def _position(self) -> Cursor:
        """Where the next batch starts."""
        raise NotImplementedError

    def _seek(self, cursor: Cursor) -> None:
        """Make the next batch start at `cursor` (one of this data's, checked)."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[GlobalBatch]:
        return self

    def __next__(self) -> GlobalBatch:
        return self.next_batch()

    def _identity(self) -> dict[str, Any]:
        spec, fingerprint = self._source()
        return {"source": spec, "seed": self.seed, "n_microbatches": self.n_microbatches,
                "microbatch_size": self.microbatch_size, "seq_len": self.seq_len,
                "fingerprint": fingerprint}

    def state(self) -> dict[str, Any]:
        """JSON-serializable position of the next batch (not the data itself)."""
        at = self._position()
        return {"version": STATE_VERSION, **self._identity(), "epoch": at.epoch,
                "index": at.index, "offset": at.offset, "batches": self._batches}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue exactly where `state` left off; ConfigError if it belongs to other data."""
        self._seek(_check_state(state, self._identity()))
        self._batches = int(state["batches"])

    @property
    def batches_served(self) -> int:
        """Global batches produced since the start of training (carried across restores)."""
        return self._batches


class BatchIterator(_ResumableBatches):
    """Endless, deterministic, resumable stream of GlobalBatch values."""

    def __init__(self, source_spec: str | DocumentSource, *, n_microbatches: int,
                 microbatch_size: int, seq_len: int, seed: int,
                 state: Mapping[str, Any] | None = None) -> None:
        super().__init__(n_microbatches, microbatch_size, seq_len)
        self.seed = _check_int("seed", seed, 0)
        self.source = _as_source(source_spec, self.seed, self.seq_len)
        self._stream = DocumentStream(self.source)
        if state is not None:
            self.restore(state)

    def next_batch(self) -> GlobalBatch:
        """The next batch, laid out from item sizes; its tokens are read per micro-batch when
        asked (`GlobalBatch.microbatch_tokens`)."""
        n_rows = self.n_microbatches * self.microbatch_size
        rows: list[list[Piece]] = [fill_row(self._stream.take, self.seq_len)
                                   for _ in range(n_rows)]
        self._batches += 1
        reader = PieceReader(self.source)
        b, seq_len = self.microbatch_size, self.seq_len

        def read_microbatch(m: int) -> np.ndarray:
            mb_rows = rows[m * b:(m + 1) * b]
            return np.stack([row_tokens(reader.read(row), seq_len) for row in mb_rows])

        lengths = tuple(tuple(p.size for p in row) for row in rows)
        return GlobalBatch.from_layout(lengths, self.n_microbatches, seq_len, read_microbatch,
                                       pieces_crc(rows))

    def _source(self) -> tuple[str, str]:
        return self.source.spec, self.source.fingerprint()

    def _position(self) -> Cursor:
        return self._stream.cursor

    def _seek(self, cursor: Cursor) -> None:
        self._stream.check_cursor(cursor)
        self._stream = DocumentStream(self.source, cursor)


class PieceReader:
    """Reads pieces' tokens from a source, keeping the last item (a document usually spans
    neighbouring pieces)."""

    def __init__(self, source: DocumentSource) -> None:
        self.source = source
        self._key: tuple[int, int] | None = None
        self._item: np.ndarray = np.zeros(0, np.int32)

    def _item_tokens(self, epoch: int, index: int) -> np.ndarray:
        if self._key != (epoch, index):
            self._key, self._item = (epoch, index), self.source.item(epoch, index)
        return self._item

    def read(self, pieces: Sequence[Piece]) -> list[np.ndarray]:
        return [self._item_tokens(p.epoch, p.index)[p.start:p.start + p.size] for p in pieces]


def pieces_crc(rows: Sequence[Sequence[Piece]]) -> int:
    """CRC-32 naming a batch's content by where its pieces come from (rows kept apart)."""
    crc = 0
    for row in rows:
        crc = zlib.crc32(np.asarray(row, np.int64).reshape(-1, 4).tobytes(), crc)
        crc = zlib.crc32(b"|", crc)
    return crc


def _check_state(state: Mapping[str, Any], identity: Mapping[str, Any]) -> Cursor:
    if not isinstance(state, Mapping):
        raise ConfigError(f"data state must be a dict from BatchIterator.state(), got {state!r}")
    missing = [k for k in ("version", *_IDENTITY_KEYS, *_POSITION_KEYS) if k not in state]
    if missing:
        raise ConfigError(f"data state is missing keys {missing}; pass BatchIterator.state()")
    if state["version"] != STATE_VERSION:
        raise ConfigError(f"data state version {state['version']!r} != {STATE_VERSION}")
    for key in _IDENTITY_KEYS:
        if state[key] != identity[key]:
            raise ConfigError(f"data state was saved with {key}={state[key]!r}, but this "
                              f"iterator has {key}={identity[key]!r}")
    for key in _POSITION_KEYS:
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"data state {key} must be a non-negative int, got {value!r}")
    return Cursor(state["epoch"], state["index"], state["offset"])
