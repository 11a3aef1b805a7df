"""Tests for the user's own data: packed batches, in-memory documents, token files, adapters."""

import json
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resihp_jax.data import (
    BatchIterator,
    GlobalBatch,
    PackedBatch,
    TokenFileSource,
    from_documents,
    from_grain,
    from_hf_dataset,
    pack_documents,
    packed_batches,
    write_token_file,
)
from resihp_jax.data.lengths import sum_sq
from resihp_jax.errors import ConfigError

M, B, S = 2, 2, 16
SHAPE = {"n_microbatches": M, "microbatch_size": B, "seq_len": S}
ROWS = M * B
N_USER_BATCHES = 5
HEADER_BYTES = 40


def _docs(seed: int = 0, n: int = 15, high: int = 1000) -> list[np.ndarray]:
    """Documents of 0..39 tokens: some empty, some longer than a row."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, int(rng.integers(0, 40))) for _ in range(n)]


def _user_batches(seed: int = 0) -> list[PackedBatch]:
    """Rows the library packs, handed in as the user's own batches (int64, ids x 7)."""
    rows = pack_documents(_docs(seed, n=40), S)
    assert rows.tokens_NxS.shape[0] >= N_USER_BATCHES * ROWS

    def part(array_NxS: np.ndarray, k: int) -> np.ndarray:
        return array_NxS[k * ROWS:(k + 1) * ROWS].astype(np.int64)

    return [PackedBatch(part(rows.tokens_NxS, k), part(rows.segment_ids_NxS, k) * 7,
                        part(rows.positions_NxS, k)) for k in range(N_USER_BATCHES)]


def _assert_same(a: GlobalBatch, b: GlobalBatch) -> None:
    np.testing.assert_array_equal(a.tokens_MxBxS, b.tokens_MxBxS)
    np.testing.assert_array_equal(a.segment_ids_MxBxS, b.segment_ids_MxBxS)
    np.testing.assert_array_equal(a.positions_MxBxS, b.positions_MxBxS)
    assert a.doc_lengths == b.doc_lengths and a.content_crc == b.content_crc


class FakeHFDataset:
    """A map-style dataset whose rows are dicts, like datasets.Dataset."""

    def __init__(self, docs: list[np.ndarray]) -> None:
        self.rows = [{"input_ids": [int(t) for t in d], "text": "x" * d.size} for d in docs]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]


class FakeGrainSource:
    """A map-style source whose records are token arrays, like a grain RandomAccessDataSource."""

    def __init__(self, docs: list[np.ndarray], dtype: Any = np.uint16) -> None:
        self.docs = [np.asarray(d, dtype) for d in docs]

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.docs[index]


# ---------- packed batches: serving ----------


def test_packed_batches_serve_the_rows_in_order_split_into_microbatches() -> None:
    batches = _user_batches()
    it = packed_batches(batches, **SHAPE)
    for k, user in enumerate(batches):
        got = it.next_batch()
        assert got.shape == (M, B, S) and got.tokens_MxBxS.dtype == np.int32
        for m in range(M):
            np.testing.assert_array_equal(got.microbatch_tokens(m), user.tokens[m * B:(m + 1) * B])
        np.testing.assert_array_equal(got.segment_ids_MxBxS.reshape(ROWS, S), user.segment_ids)
        np.testing.assert_array_equal(got.positions_MxBxS.reshape(ROWS, S), user.positions)
        assert it.batches_served == k + 1
    rows = pack_documents(_docs(0, n=40), S)  # the lengths come back from the segment ids
    first = packed_batches(batches, **SHAPE).next_batch()
    assert first.doc_lengths == (rows.doc_lengths[:B], rows.doc_lengths[B:ROWS])
    np.testing.assert_array_equal(
        first.sum_sq_lengths(), [sum_sq(n for row in rows.doc_lengths[m * B:(m + 1) * B]
                                        for n in row) for m in range(M)])
    _assert_same(it.next_batch(), packed_batches(batches, **SHAPE).next_batch())  # epoch 2
    assert it.state()["epoch"] == 1 and it.state()["index"] == 1


def test_document_lengths_follow_any_positive_ids_and_inner_padding() -> None:
    seg_S = np.array([5, 5, 9, 9, 9, 0, 0, 2, 2, 2, 2, 0, 3, 0, 0, 0])
    pos_S = np.array([0, 1, 0, 1, 2, 0, 0, 0, 1, 2, 3, 7, 0, 0, 0, 0])  # padding: any
    user = PackedBatch(np.arange(ROWS * S).reshape(ROWS, S), np.tile(seg_S, (ROWS, 1)),
                       np.tile(pos_S, (ROWS, 1)))
    got = packed_batches([user], **SHAPE).next_batch()
    assert got.doc_lengths == (((2, 3, 4, 1),) * B,) * M
    np.testing.assert_array_equal(got.sum_sq_lengths(), [2 * (4 + 9 + 16 + 1)] * M)


def test_a_function_source_is_read_lazily_and_repeats() -> None:
    batches, calls = _user_batches(), []

    def data() -> Any:
        calls.append(1)
        return iter(batches)

    it = packed_batches(data, **SHAPE)
    assert not calls  # nothing read before the first batch or state()
    got = [it.next_batch() for _ in range(2 * N_USER_BATCHES + 1)]
    assert len(calls) == 3  # one iterator per epoch
    for k, batch in enumerate(got):
        np.testing.assert_array_equal(batch.tokens_MxBxS.reshape(ROWS, S),
                                      batches[k % N_USER_BATCHES].tokens)


# ---------- resume: every source kind ----------

KINDS = ["packed_list", "packed_function", "documents", "token_file", "hf_dataset", "grain"]
N_SERVED = 12  # more than an epoch of every kind


def _iterator_maker(kind: str, tmp_path: Path) -> Callable[[Any], Any]:
    """state -> a fresh iterator over `kind`'s data, restored to `state` if not None."""
    docs = _docs(1)
    if kind == "packed_list":
        return lambda state: packed_batches(_user_batches(), state=state, **SHAPE)
    if kind == "packed_function":
        return lambda state: packed_batches(lambda: iter(_user_batches()), state=state, **SHAPE)
    if kind == "token_file":
        write_token_file(tmp_path / "docs.tok", docs)
    sources = {"documents": lambda: from_documents(docs),
               "token_file": lambda: TokenFileSource(tmp_path / "docs.tok"),
               "hf_dataset": lambda: from_hf_dataset(FakeHFDataset(docs)),
               "grain": lambda: from_grain(FakeGrainSource(docs))}
    return lambda state: BatchIterator(sources[kind](), seed=0, state=state, **SHAPE)


@pytest.mark.parametrize("kind", KINDS)
def test_resume_from_any_position_matches_an_uninterrupted_run(kind: str,
                                                              tmp_path: Path) -> None:
    make = _iterator_maker(kind, tmp_path)
    it, states, expected = make(None), [], []
    for _ in range(N_SERVED):
        states.append(json.loads(json.dumps(it.state())))  # as a checkpoint keeps it
        expected.append(it.next_batch())
    assert states[-1]["epoch"] >= 1  # the run crossed an epoch
    for k in (0, 1, 4, 7, N_SERVED - 1):
        resumed = make(states[k])
        assert resumed.batches_served == k
        for j in range(k, N_SERVED):
            _assert_same(resumed.next_batch(), expected[j])
    for k in (N_SERVED - 1, 2, 9):  # a rollback in place: one step back, further back
        it.restore(states[k])
        _assert_same(it.next_batch(), expected[k])


def test_a_one_step_rollback_recreates_no_iterator() -> None:
    calls = []

    def data() -> Any:
        calls.append(1)
        return iter(_user_batches())

    it = packed_batches(data, **SHAPE)
    it.next_batch()
    before, n_calls = it.state(), len(calls)
    first = it.next_batch()
    it.restore(before)
    _assert_same(it.next_batch(), first)
    assert len(calls) == n_calls


def test_state_of_packed_batches_carries_the_run_identity() -> None:
    state = packed_batches(_user_batches(), **SHAPE).state()
    assert json.loads(json.dumps(state)) == state
    assert state["source"] == "packed_batches" and state["seed"] is None
    assert {k: state[k] for k in SHAPE} == SHAPE
    other = packed_batches(_user_batches(seed=5), **SHAPE)
    assert other.state()["fingerprint"] != state["fingerprint"]


# ---------- packed batches: errors ----------


def _good_batch() -> PackedBatch:
    lengths = [4, 4, 8]
    seg_S = np.repeat([1, 2, 3], lengths)
    pos_S = np.concatenate([np.arange(n) for n in lengths])
    return PackedBatch(np.ones((ROWS, S), np.int32), np.tile(seg_S, (ROWS, 1)),
                       np.tile(pos_S, (ROWS, 1)))


def _edited(field: str, edit: Callable[[np.ndarray], np.ndarray]) -> PackedBatch:
    good = _good_batch()
    return good._replace(**{field: edit(getattr(good, field).copy())})


def _set(row: int, column: int, value: int) -> Callable[[np.ndarray], np.ndarray]:
    def edit(array_RxS: np.ndarray) -> np.ndarray:
        array_RxS[row, column] = value
        return array_RxS
    return edit


BAD_BATCHES = [
    (_edited("tokens", lambda a: a[:3]), r"batch 1: tokens has shape \(3, 16\), expected "
                                         r"\(4, 16\)"),
    (_edited("positions", lambda a: a[:, :8]), r"positions has shape \(4, 8\), expected"),
    (_edited("segment_ids", lambda a: a.astype(np.float32)),
     "batch 1: segment_ids has dtype float32; valid: an integer dtype"),
    (_edited("tokens", lambda a: a.astype(bool)), "tokens has dtype bool"),
    (_edited("segment_ids", _set(2, 5, -1)), r"batch 1, row 2: segment_ids\[5\] is -1; valid: "
                                             "0 .. 2147483647"),
    (_edited("tokens", _set(0, 0, -3)), r"batch 1, row 0: tokens\[0\] is -3"),
    (_edited("tokens", lambda a: a.astype(np.int64) + 2**31), r"tokens\[0\] is 2147483649"),
    (_edited("positions", _set(3, 4, 4)), r"batch 1, row 3: positions\[4\] is 4, expected 0: "
                                          "positions count 0, 1, 2, ... from the start of each "
                                          "document$"),
    (_edited("positions", _set(1, 9, 7)), r"batch 1, row 1: positions\[9\] is 7, expected 1"),
    (_edited("segment_ids", lambda a: np.where(a == 2, 1, a)),
     r"batch 1, row 0: positions\[4\] is 0, expected 4.*adjacent documents need different "
     "segment ids"),
    (_edited("segment_ids", lambda a: np.where(a == 3, 1, a)),
     "batch 1, row 0: segment id 1 comes back at column 8 after another document"),
    ({"tokens": 1}, "batch 1 must be a PackedBatch.*got dict"),
    ((np.ones((ROWS, S)),) * 2, "batch 1 must be a PackedBatch.*got tuple"),
]


@pytest.mark.parametrize("bad, match", BAD_BATCHES)
def test_each_bad_batch_is_named(bad: Any, match: str) -> None:
    it = packed_batches([_good_batch(), bad], **SHAPE)
    it.next_batch()
    with pytest.raises(ConfigError, match=match):
        it.next_batch()


def _no_batches() -> Any:
    return iter([])


@pytest.mark.parametrize("data, match", [
    ([], "empty sequence"),
    (iter([_good_batch()]), "got an iterator .* pass a function returning a fresh iterator"),
    ((b for b in [_good_batch()]), "got an iterator"),
    (_good_batch(), r"got a single one; pass \[batch\]"),
    (3, "takes a sequence of PackedBatch or a function .* got int"),
    (_no_batches, "returned an iterator with no batches"),
    (lambda: 3, "must return an iterator of PackedBatch, got int"),
])
def test_bad_data_is_named(data: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        packed_batches(data, **SHAPE).next_batch()


def test_bad_shape_and_state_are_named() -> None:
    with pytest.raises(ConfigError, match="n_microbatches must be a positive int, got 0"):
        packed_batches([_good_batch()], n_microbatches=0, microbatch_size=B, seq_len=S)
    batches = _user_batches()
    state = packed_batches(batches, **SHAPE).state()
    with pytest.raises(ConfigError, match="fingerprint="):
        packed_batches(_user_batches(seed=5), state=state, **SHAPE)
    with pytest.raises(ConfigError, match="source='synthetic:uniform'"):
        packed_batches(batches, state=BatchIterator("synthetic:uniform", seed=0,
                                                    **SHAPE).state(), **SHAPE)
    with pytest.raises(ConfigError, match="index=9 is past the 5 batches"):
        packed_batches(batches, state={**state, "index": 9}, **SHAPE)
    with pytest.raises(ConfigError, match="offset=2 must be 0"):
        packed_batches(batches, state={**state, "offset": 2}, **SHAPE)
    fn_state = packed_batches(lambda: iter(batches), **SHAPE).state()
    with pytest.raises(ConfigError, match=r"index=9 is past the end .* \(it gave 5\)"):
        packed_batches(lambda: iter(batches), state={**fn_state, "index": 9}, **SHAPE)


# ---------- documents in memory ----------


def test_batch_iterator_packs_documents_like_pack_documents() -> None:
    docs = _docs(2)
    it = BatchIterator(from_documents(docs), seed=0, **SHAPE)
    rows = pack_documents(docs + docs, S)  # epochs follow one another in the same order
    n_batches = 4
    assert rows.tokens_NxS.shape[0] > n_batches * ROWS
    for k in range(n_batches):
        rows_k = slice(k * ROWS, (k + 1) * ROWS)
        got = it.next_batch()
        np.testing.assert_array_equal(got.tokens_MxBxS.reshape(ROWS, S),
                                      rows.tokens_NxS[rows_k])
        np.testing.assert_array_equal(got.segment_ids_MxBxS.reshape(ROWS, S),
                                      rows.segment_ids_NxS[rows_k])
        assert sum(got.doc_lengths, ()) == rows.doc_lengths[rows_k]


def test_documents_fingerprint_follows_the_content() -> None:
    docs = _docs(3)
    base = from_documents(docs).fingerprint()
    assert from_documents([d.copy() for d in docs]).fingerprint() == base
    assert from_documents([d.astype(np.uint16) for d in docs]).fingerprint() == base
    changed = [d.copy() for d in docs]
    changed[4][0] += 1
    split = [docs[0][:1], docs[0][1:], *docs[1:]]
    others = [changed, docs[::-1], split, docs[:-1]]
    assert len({base, *(from_documents(d).fingerprint() for d in others)}) == 1 + len(others)


def test_documents_are_copied() -> None:
    docs = [np.arange(5)]
    source = from_documents(docs)
    docs[0][0] = 99
    np.testing.assert_array_equal(source.item(0, 0), np.arange(5))
    assert source.item(0, 0).dtype == np.int32


@pytest.mark.parametrize("docs, match", [
    ([np.arange(3), np.ones((2, 2), int)], r"document 1 must be a 1-D array .* shape \(2, 2\)"),
    ([np.arange(3.0)], "document 0 must hold integer token ids, got dtype float64"),
    ([np.array([1, -2])], "document 0 holds token id -2 at position 1; valid ids are 0 .. "
                          "2147483647"),
    ([np.array([2**31])], "token id 2147483648"),
    ([[1, 2], [3, [4]]], "document 1 must be a 1-D array"),
    ([np.arange(2), "hello"], r"document 1 holds text \('hello'\), not token ids: tokenize"),
    ([], "empty dataset"),
    ([[], np.zeros(0, int)], "2 documents, all empty"),
    ((d for d in [np.arange(3)]), "map-style dataset .* got generator"),
    ("abc", "got str"),
])
def test_bad_documents_are_named(docs: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        from_documents(docs)


def test_batch_iterator_refuses_an_object_that_is_no_source() -> None:
    with pytest.raises(ConfigError, match="lacks items_per_epoch, item_size, item, "
                                          "fingerprint, spec, max_doc_len"):
        BatchIterator([_good_batch()], seed=0, **SHAPE)  # type: ignore[arg-type]


# ---------- token files ----------


def test_token_file_round_trip_reads_documents_in_any_order(tmp_path: Path) -> None:
    docs = _docs(4, n=30)
    path = write_token_file(tmp_path / "docs.tok", docs)
    source = TokenFileSource(path)
    assert (source.n_documents, source.n_tokens) == (30, sum(d.size for d in docs))
    assert source.items_per_epoch() == 30 and source.max_doc_len is None
    order = np.random.default_rng(0).permutation(30)
    for i in [*order, *order[::-1]]:
        assert source.item_size(0, int(i)) == docs[i].size
        got = source.item(3, int(i))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, docs[i])
    assert source.fingerprint() == from_documents(docs).fingerprint()


def test_token_file_reads_only_the_slice_asked_for(tmp_path: Path) -> None:
    """A document is read from the map when asked: bytes changed on disk after opening show
    in that document only (nothing was read or copied ahead of time)."""
    docs = [np.arange(10) + 100 * k for k in range(4)]
    path = write_token_file(tmp_path / "docs.tok", docs)
    source = TokenFileSource(path)
    tokens_at = HEADER_BYTES + 8 * (len(docs) + 1)
    with path.open("r+b") as f:  # overwrite document 2 (uint16 ids) in place
        f.seek(tokens_at + 2 * 20)
        f.write(np.full(10, 7, "<u2").tobytes())
    for k in (3, 1, 0):
        np.testing.assert_array_equal(source.item(0, k), docs[k])
    np.testing.assert_array_equal(source.item(0, 2), np.full(10, 7))


@pytest.mark.parametrize("max_id, dtype, width", [(65535, np.uint16, 2), (65536, np.uint32, 4),
                                                  (2**31 - 1, np.uint32, 4)])
def test_token_width_follows_the_largest_id(tmp_path: Path, max_id: int, dtype: type,
                                            width: int) -> None:
    docs = [np.array([0, 1, max_id]), np.array([], np.int64), np.array([5])]
    path = write_token_file(tmp_path / "w.tok", docs)
    source = TokenFileSource(path)
    assert source.token_dtype == np.dtype(dtype)
    assert path.stat().st_size == HEADER_BYTES + 8 * 4 + width * 4
    assert [source.item_size(0, i) for i in range(3)] == [3, 0, 1]
    np.testing.assert_array_equal(source.item(0, 0), [0, 1, max_id])


def test_token_file_batches_equal_in_memory_batches(tmp_path: Path) -> None:
    docs = _docs(5)
    path = write_token_file(str(tmp_path / "docs.tok"), docs)
    from_file = BatchIterator(TokenFileSource(path), seed=0, **SHAPE)
    in_memory = BatchIterator(from_documents(docs), seed=0, **SHAPE)
    for _ in range(6):
        _assert_same(from_file.next_batch(), in_memory.next_batch())


def test_token_file_fingerprint_follows_the_content(tmp_path: Path) -> None:
    docs = _docs(6)
    a = TokenFileSource(write_token_file(tmp_path / "a.tok", docs)).fingerprint()
    b = TokenFileSource(write_token_file(tmp_path / "b.tok", docs)).fingerprint()
    changed = [d.copy() for d in docs]
    changed[-1][-1] += 1
    c = TokenFileSource(write_token_file(tmp_path / "c.tok", changed)).fingerprint()
    assert a == b != c


def _patched(path: Path, at: int, data: bytes) -> Path:
    raw = bytearray(path.read_bytes())
    raw[at:at + len(data)] = data
    path.write_bytes(bytes(raw))
    return path


def _token_file(tmp_path: Path) -> Path:
    return write_token_file(tmp_path / "t.tok", [np.arange(5), np.arange(3)])


BAD_FILES = [
    (lambda p: p / "missing.tok", r"cannot read token file '.*missing.tok': No such file"),
    (lambda p: p, r"cannot read token file '.*': Is a directory"),
    (lambda p: _patched(_token_file(p), 0, b"NOTATOKN"), r"'.*t.tok' is not a token file"),
    (lambda p: (p / "short.tok").write_bytes(b"RHTOK") and p / "short.tok",
     "short.tok' is not a token file"),
    (lambda p: _token_file(p).write_bytes(_token_file(p).read_bytes()[:-1]) and p / "t.tok",
     r"token file '.*t.tok' is truncated: 79 bytes, but its header \(2 documents, 8 tokens "
     r"of 2 bytes\) needs 80"),
    (lambda p: _token_file(p).write_bytes(_token_file(p).read_bytes() + b"\0") and p / "t.tok",
     "has extra bytes: 81 bytes"),
    (lambda p: _patched(_token_file(p), 8, struct.pack("<Q", 3)),
     "t.tok' has token width 3; valid: 2 or 4 bytes"),
    (lambda p: _patched(_token_file(p), HEADER_BYTES + 16, struct.pack("<Q", 7)),
     "t.tok' is damaged: its offsets run from 0 to 7, not 0 to 8"),
]


@pytest.mark.parametrize("make_path, match", BAD_FILES)
def test_bad_token_files_are_named(tmp_path: Path, make_path: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TokenFileSource(make_path(tmp_path))


def test_damaged_offsets_are_named_when_read(tmp_path: Path) -> None:
    path = _patched(_token_file(tmp_path), HEADER_BYTES + 8, struct.pack("<Q", 99))
    source = TokenFileSource(path)
    with pytest.raises(ConfigError, match=r"t.tok' is damaged: document 0 has offsets \[0, "
                                          r"99\) outside its 8 tokens"):
        source.item_size(0, 0)


def test_bad_token_file_writes_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot write token file '.*no/such/dir/t.tok'"):
        write_token_file(tmp_path / "no" / "such" / "dir" / "t.tok", [np.arange(3)])
    with pytest.raises(ConfigError, match="document 1 holds token id 4294967296"):
        write_token_file(tmp_path / "t.tok", [np.arange(3), np.array([2**32])])
    with pytest.raises(ConfigError, match="1 documents, all empty"):
        write_token_file(tmp_path / "t.tok", [[]])
    with pytest.raises(ConfigError, match="needs a file path .* got 3"):
        TokenFileSource(3)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []  # nothing half-written is left behind


# ---------- adapters: Hugging Face datasets, Grain ----------


def test_adapters_give_the_documents(tmp_path: Path) -> None:
    docs = _docs(7)
    reference = [from_documents(docs).item(0, i) for i in range(len(docs))]
    for source in (from_hf_dataset(FakeHFDataset(docs)), from_grain(FakeGrainSource(docs)),
                   from_grain(FakeHFDataset(docs), key="input_ids")):
        assert source.items_per_epoch() == len(docs)
        for i in reversed(range(len(docs))):
            assert source.item_size(0, i) == docs[i].size
            np.testing.assert_array_equal(source.item(1, i), reference[i])
            assert source.item(1, i).dtype == np.int32
    hf = BatchIterator(from_hf_dataset(FakeHFDataset(docs)), seed=0, **SHAPE)
    in_memory = BatchIterator(from_documents(docs), seed=0, **SHAPE)
    for _ in range(4):
        _assert_same(hf.next_batch(), in_memory.next_batch())


def test_adapter_fingerprints_sample_the_records() -> None:
    docs = _docs(8)
    base = from_grain(FakeGrainSource(docs)).fingerprint()
    assert from_grain(FakeGrainSource([d.copy() for d in docs])).fingerprint() == base
    changed = [d.copy() for d in docs]
    changed[0][0] += 1  # the first record is always sampled
    assert from_grain(FakeGrainSource(changed)).fingerprint() != base
    assert from_grain(FakeGrainSource(docs[:-1])).fingerprint() != base


class _IterableOnly:
    def __iter__(self) -> Any:
        return iter([])


class _Endless(FakeGrainSource):
    """Grain's MapDataset.repeat() with no epoch count: its len is sys.maxsize."""

    def __init__(self) -> None:
        super().__init__(_docs())

    def __len__(self) -> int:
        return sys.maxsize


@pytest.mark.parametrize("make, match", [
    (lambda: from_hf_dataset(FakeHFDataset(_docs()), column="ids"),
     r"hf_dataset:ids record 0 has no column 'ids'; it has \['input_ids', 'text'\]"),
    (lambda: from_grain(FakeGrainSource(_docs()), key="ids"),
     "grain:ids record 0 has no column 'ids'; it has ndarray"),
    (lambda: from_hf_dataset(_IterableOnly()),
     r"hf_dataset:input_ids needs a map-style dataset with len\(\) and \[i\], got "
     r"_IterableOnly; pass a datasets.Dataset \(load it without streaming=True\)"),
    (lambda: from_grain(_IterableOnly()),
     r"grain needs a map-style .* got _IterableOnly; pass the grain.MapDataset \(before "
     r"\.to_iter_dataset\(\)"),
    (lambda: from_hf_dataset({"train": FakeHFDataset(_docs())}),
     r"got a dict with keys \['train'\]; pass one split \(data\['train'\]\)"),
    (lambda: from_grain(_Endless()), "got a dataset without end .* drop its .repeat"),
    (lambda: from_grain(FakeGrainSource([])), "got an empty dataset"),
    (lambda: from_grain(FakeGrainSource([np.arange(3.0)], np.float32)),
     "grain record 0 must hold integer token ids, got dtype float32"),
])
def test_adapter_errors_are_named(make: Callable[[], Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make()


def test_a_real_hugging_face_dataset() -> None:
    datasets = pytest.importorskip("datasets", reason="the datasets package is not installed "
                                                      "(an optional extra: resihp_jax[hf])")
    docs = _docs(9)
    ds = datasets.Dataset.from_dict({"input_ids": [[int(t) for t in d] for d in docs]})
    source = from_hf_dataset(ds)
    for i in range(len(docs)):
        np.testing.assert_array_equal(source.item(0, i), docs[i])
    hf = BatchIterator(source, seed=0, **SHAPE)
    in_memory = BatchIterator(from_documents(docs), seed=0, **SHAPE)
    for _ in range(3):
        _assert_same(hf.next_batch(), in_memory.next_batch())


def _text_files(tmp_path: Path, docs: list[np.ndarray]) -> list[str]:
    """Each document as a text file of its bytes (ids mod 95 as printable ASCII)."""
    paths = []
    for i, doc in enumerate(docs):
        path = tmp_path / f"doc{i:02d}.txt"
        path.write_bytes((doc % 95 + 32).astype(np.uint8).tobytes())
        paths.append(str(path))
    return paths


def test_a_hugging_face_text_dataset_from_local_files(tmp_path: Path) -> None:
    """load_dataset('text') over local files, tokenized by .map, as the hf example does."""
    datasets = pytest.importorskip("datasets", reason="the datasets package is not installed "
                                                      "(an optional extra: resihp_jax[hf])")
    docs = [d for d in _docs(10) if d.size]  # the text loader keeps no empty file
    expected = [d % 95 + 32 for d in docs]
    loaded = datasets.load_dataset("text", data_files=_text_files(tmp_path, docs),
                                   sample_by="document", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"got a DatasetDict with keys \['train'\]; pass one "
                                          r"split \(data\['train'\]\)"):
        from_hf_dataset(loaded)
    ds = loaded["train"].map(lambda row: {"input_ids": list(row["text"].encode())},
                             remove_columns=["text"])
    for rows in (ds, ds.with_format("numpy")):
        source = from_hf_dataset(rows)
        assert source.items_per_epoch() == len(docs)
        for i in reversed(range(len(docs))):
            np.testing.assert_array_equal(source.item(0, i), expected[i])
        assert source.fingerprint() == from_grain(expected).fingerprint()
        hf = BatchIterator(source, seed=0, **SHAPE)
        in_memory = BatchIterator(from_documents(expected), seed=0, **SHAPE)
        for _ in range(3):
            _assert_same(hf.next_batch(), in_memory.next_batch())
    with pytest.raises(ConfigError, match=r"hf_dataset:text record 0 holds text \('.*'\), "
                                          "not token ids: tokenize it first"):
        from_hf_dataset(loaded["train"], column="text")
    with pytest.raises(ConfigError, match="got IterableDataset; pass a datasets.Dataset"):
        from_hf_dataset(ds.to_iterable_dataset())


def test_a_grain_map_dataset_with_a_filter(tmp_path: Path) -> None:
    """A grain MapDataset pipeline (source, map, filter, shuffle): records a filter dropped
    read as empty documents, and the order is the pipeline's own."""
    grain = pytest.importorskip("grain", reason="the grain package is not installed "
                                                "(an optional extra: resihp_jax[grain])")
    docs = _docs(11)
    kept = [d if d.size % 3 else np.zeros(0, np.int64) for d in docs]
    ds = (grain.MapDataset.source(_text_files(tmp_path, docs))
          .map(lambda path: np.frombuffer(Path(path).read_bytes(), np.uint8))
          .filter(lambda tokens: tokens.size % 3 != 0))
    assert ds[[i for i, d in enumerate(docs) if d.size % 3 == 0][0]] is None  # grain's marker
    expected = [d % 95 + 32 for d in kept]
    source = from_grain(ds)
    for i in range(len(docs)):
        assert source.item_size(0, i) == expected[i].size
        np.testing.assert_array_equal(source.item(0, i), expected[i])
    batches = BatchIterator(source, seed=0, **SHAPE)
    in_memory = BatchIterator(from_documents(expected), seed=0, **SHAPE)
    for _ in range(3):
        _assert_same(batches.next_batch(), in_memory.next_batch())
    shuffled = ds.shuffle(seed=4)
    order = [next(i for i, e in enumerate(expected) if shuffled[k] is not None
                  and np.array_equal(shuffled[k], e)) if shuffled[k] is not None else None
             for k in range(len(docs))]
    assert order != list(range(len(docs)))  # it did shuffle
    as_dicts = from_grain(shuffled.map(lambda tokens: {"ids": tokens}), key="ids")
    for k in range(len(docs)):
        want = np.zeros(0) if order[k] is None else expected[order[k]]
        np.testing.assert_array_equal(as_dicts.item(0, k), want)
    with pytest.raises(ConfigError, match=r"got a dataset without end \(len \d+\)"):
        from_grain(ds.repeat())
    assert from_grain(ds.repeat(2)).items_per_epoch() == 2 * len(docs)
    with pytest.raises(ConfigError, match="got PrefetchIterDataset; pass the grain.MapDataset"):
        from_grain(ds.to_iter_dataset())
