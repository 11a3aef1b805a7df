"""Batches the user packed themselves, served like `BatchIterator` serves the library's.

`packed_batches(data, ...)` takes a sequence of `PackedBatch` or a function returning a fresh
iterator of them, checks each batch and repeats the data endlessly; the position is (epoch,
batch index), so a restore re-creates a function's iterator and skips the batches served.
"""

import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from resihp_jax.data.iterator import Cursor, _ResumableBatches
from resihp_jax.data.packing import GlobalBatch, PackedRows
from resihp_jax.errors import ConfigError

SOURCE = "packed_batches"
RECENT_BATCHES = 4  # kept so a rollback of a step or two re-creates no iterator
INT32 = np.iinfo(np.int32)
_END = object()  # what next() gives for an iterator that has run out


class PackedBatch(NamedTuple):
    """One global batch packed by the user: int arrays [rows, seq_len]."""

    tokens: np.ndarray
    segment_ids: np.ndarray  # positive per document, 0 for padding
    positions: np.ndarray  # 0, 1, 2, ... from the start of each document


Position = tuple[int, int]  # (epoch, index of the batch in the data)


def _int32_field(value: Any, name: str, where: str, shape: tuple[int, int]) -> np.ndarray:
    try:
        array_RxS = np.asarray(value)
    except (TypeError, ValueError) as err:  # ragged nested lists, for one
        raise ConfigError(f"{where}: {name} is not an array of shape {shape}: {err}") from None
    if array_RxS.shape != shape:
        raise ConfigError(f"{where}: {name} has shape {array_RxS.shape}, expected {shape} "
                          "(n_microbatches x microbatch_size rows of seq_len tokens)")
    if not np.issubdtype(array_RxS.dtype, np.integer):
        raise ConfigError(f"{where}: {name} has dtype {array_RxS.dtype}; valid: an integer "
                          "dtype")
    low = 0 if name in ("tokens", "segment_ids") else INT32.min
    bad_RxS = (array_RxS < low) | (array_RxS > INT32.max)
    if bad_RxS.any():
        row, column = (int(i) for i in np.argwhere(bad_RxS)[0])
        raise ConfigError(f"{where}, row {row}: {name}[{column}] is "
                          f"{int(array_RxS[row, column])}; valid: {low} .. {INT32.max}")
    return array_RxS.astype(np.int32)


def _check_documents(seg_RxS: np.ndarray, pos_RxS: np.ndarray, where: str) -> None:
    """ConfigError unless positions count 0, 1, ... in every run of one segment id and no
    segment id comes back after another document (attention would join the two)."""
    starts_RxS = (seg_RxS != 0) & (seg_RxS != np.pad(seg_RxS, ((0, 0), (1, 0)))[:, :-1])
    columns_S = np.arange(seg_RxS.shape[1])
    run_start_RxS = np.maximum.accumulate(np.where(starts_RxS, columns_S, 0), axis=1)
    bad_RxS = (seg_RxS != 0) & (pos_RxS != columns_S - run_start_RxS)
    if bad_RxS.any():
        row, column = (int(i) for i in np.argwhere(bad_RxS)[0])
        hint = (" (adjacent documents need different segment ids)"
                if pos_RxS[row, column] == 0 else "")
        raise ConfigError(
            f"{where}, row {row}: positions[{column}] is {int(pos_RxS[row, column])}, "
            f"expected {int(columns_S[column] - run_start_RxS[row, column])}: positions "
            f"count 0, 1, 2, ... from the start of each document{hint}")
    for row in range(seg_RxS.shape[0]):
        ids = seg_RxS[row, starts_RxS[row]]
        if len(np.unique(ids)) < len(ids):
            repeat = next(i for i in range(len(ids)) if ids[i] in ids[:i])
            column = int(np.flatnonzero(starts_RxS[row])[repeat])
            raise ConfigError(
                f"{where}, row {row}: segment id {int(ids[repeat])} comes back at column "
                f"{column} after another document; give each document of a row its own id")


def _run_lengths(seg_RxS: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """Per row, the lengths of its documents (runs of one positive segment id)."""
    padded_RxS = np.pad(seg_RxS, ((0, 0), (1, 1)))
    starts_RxS = (seg_RxS != 0) & (seg_RxS != padded_RxS[:, :-2])
    ends_RxS = (seg_RxS != 0) & (seg_RxS != padded_RxS[:, 2:])
    return tuple(tuple(int(n) for n in np.flatnonzero(e) - np.flatnonzero(s) + 1)
                 for s, e in zip(starts_RxS, ends_RxS))


def check_packed_batch(batch: Any, index: int, shape: tuple[int, int]) -> PackedRows:
    """`batch` (batch `index` of the data) as checked int32 rows with their document lengths;
    ConfigError naming the batch, the row and what is valid otherwise."""
    where = f"batch {index}"
    if not isinstance(batch, tuple) or len(batch) != 3:
        raise ConfigError(f"{where} must be a PackedBatch(tokens, segment_ids, positions), "
                          f"got {type(batch).__name__}")
    tokens_RxS, seg_RxS, pos_RxS = (_int32_field(value, name, where, shape)
                                    for value, name in zip(batch, PackedBatch._fields))
    _check_documents(seg_RxS, pos_RxS, where)
    return PackedRows(tokens_RxS, seg_RxS, pos_RxS, _run_lengths(seg_RxS))


class _SequenceReader:
    """Batches of a sequence, by index."""

    def __init__(self, data: Sequence[Any]) -> None:
        self.data = data
        self.per_epoch: int | None = len(data)
        if not self.per_epoch:
            raise ConfigError("packed_batches got an empty sequence; it needs at least one "
                              "PackedBatch")

    def seek(self, at: Position) -> None:
        if at[1] >= len(self.data):
            raise ConfigError(f"data state index={at[1]} is past the {len(self.data)} batches")

    def read(self, at: Position) -> tuple[Any, Position, Position]:
        """(batch, where it was read, the position after it)."""
        epoch, index = at
        after = (epoch + 1, 0) if index + 1 == len(self.data) else (epoch, index + 1)
        return self.data[index], at, after


class _FunctionReader:
    """Batches of the iterators a function returns: one kept live at the next position, the
    last few batches kept for rollbacks, a fresh one skipped forward for other positions."""

    def __init__(self, batches: Callable[[], Any]) -> None:
        self.batches = batches
        self.per_epoch: int | None = None
        self._live: Iterator[Any] = iter(())
        self._live_at: Position | None = None  # where the live iterator is
        self._recent: OrderedDict[Position, tuple[Any, Position, Position]] = OrderedDict()

    def _fresh(self, epoch: int) -> None:
        batches = self.batches()
        if not hasattr(batches, "__iter__"):
            raise ConfigError("packed_batches: the data function must return an iterator of "
                              f"PackedBatch, got {type(batches).__name__}")
        self._live, self._live_at = iter(batches), (epoch, 0)

    def seek(self, at: Position) -> None:
        if at in self._recent or at == self._live_at:
            return
        self._fresh(at[0])
        for skipped in range(at[1]):
            if next(self._live, _END) is _END:
                self._live_at = None
                raise ConfigError(f"data state index={at[1]} is past the end of the "
                                  f"data function's batches (it gave {skipped})")
        self._live_at = at

    def read(self, at: Position) -> tuple[Any, Position, Position]:
        if at in self._recent:
            return self._recent[at]
        self.seek(at)
        batch, read_at = next(self._live, _END), at
        if batch is _END:  # the epoch ended: the next one starts with a fresh iterator
            if at[1] == 0:
                raise ConfigError("packed_batches: the data function returned an iterator "
                                  "with no batches")
            read_at = (at[0] + 1, 0)
            self._fresh(read_at[0])
            batch = next(self._live, _END)
            if batch is _END:
                raise ConfigError("packed_batches: the data function returned no batches "
                                  f"for epoch {read_at[0]} (it gave {at[1]} before)")
        after = (read_at[0], read_at[1] + 1)
        self._live_at = after
        self._recent[at] = (batch, read_at, after)
        while len(self._recent) > RECENT_BATCHES:
            self._recent.popitem(last=False)
        return self._recent[at]


def _reader(data: Any) -> _SequenceReader | _FunctionReader:
    if hasattr(data, "__next__"):
        raise ConfigError(
            f"packed_batches got an iterator ({type(data).__name__}), which can be read only "
            "once, so a run could not resume; pass a function returning a fresh iterator "
            "(e.g. lambda: my_batches()) or a sequence of PackedBatch")
    if isinstance(data, PackedBatch):
        raise ConfigError("packed_batches takes a sequence of PackedBatch, got a single one; "
                          "pass [batch]")
    if (hasattr(data, "__len__") and hasattr(data, "__getitem__")
            and not isinstance(data, str | bytes | Mapping)):
        return _SequenceReader(data)
    if callable(data):
        return _FunctionReader(data)
    raise ConfigError(f"packed_batches takes a sequence of PackedBatch or a function returning "
                      f"an iterator of them, got {type(data).__name__}")


class PackedBatchIterator(_ResumableBatches):
    """Endless, resumable stream of GlobalBatch values from the user's packed batches (the
    surface of BatchIterator: next_batch, state, restore, batches_served)."""

    seed = None  # the user's batches take no seed; kept for the run's identity

    def __init__(self, data: Any, *, n_microbatches: int, microbatch_size: int,
                 seq_len: int, state: Mapping[str, Any] | None = None) -> None:
        super().__init__(n_microbatches, microbatch_size, seq_len)
        self._reader = _reader(data)
        self._at: Position = (0, 0)
        self._fingerprint: str | None = None
        if state is not None:
            self.restore(state)

    @property
    def rows_shape(self) -> tuple[int, int]:
        """(rows, seq_len) every PackedBatch must have."""
        return self.n_microbatches * self.microbatch_size, self.seq_len

    def _checked(self, at: Position) -> tuple[PackedRows, Position]:
        batch, read_at, after = self._reader.read(at)
        return check_packed_batch(batch, read_at[1], self.rows_shape), after

    def next_batch(self) -> GlobalBatch:
        """The next batch, checked; micro-batch m is rows [m*B, (m+1)*B)."""
        rows, self._at = self._checked(self._at)
        self._batches += 1
        return GlobalBatch.from_rows(rows, self.n_microbatches)

    def fingerprint(self) -> str:
        """Batches per epoch (or 'stream') and a CRC of the first batch, read once."""
        if self._fingerprint is None:
            rows, _ = self._checked((0, 0))
            crc = 0
            for array_RxS in (rows.tokens_NxS, rows.segment_ids_NxS, rows.positions_NxS):
                crc = zlib.crc32(array_RxS.tobytes(), crc)
            self._fingerprint = f"{self._reader.per_epoch or 'stream'}:{crc:08x}"
        return self._fingerprint

    def _source(self) -> tuple[str, str]:
        return SOURCE, self.fingerprint()

    def _position(self) -> Cursor:
        return Cursor(*self._at)

    def _seek(self, cursor: Cursor) -> None:
        if cursor.offset != 0:
            raise ConfigError(f"data state offset={cursor.offset} must be 0 for packed batches")
        self._reader.seek((cursor.epoch, cursor.index))
        self._at = (cursor.epoch, cursor.index)


def packed_batches(data: Sequence[PackedBatch] | Callable[[], Iterator[PackedBatch]], *,
                   n_microbatches: int, microbatch_size: int, seq_len: int,
                   state: Mapping[str, Any] | None = None) -> PackedBatchIterator:
    """The user's packed batches as the trainer's batch iterator (see PackedBatchIterator)."""
    return PackedBatchIterator(data, n_microbatches=n_microbatches,
                               microbatch_size=microbatch_size, seq_len=seq_len, state=state)
