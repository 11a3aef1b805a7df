"""Tests for resihp_jax.data: packing, sources, distributions, resumable iteration, errors."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from resihp_jax.data import (
    BatchIterator,
    CorpusSource,
    GlobalBatch,
    PackedRows,
    SyntheticSource,
    coefficient_of_variation,
    length_summary,
    make_source,
    pack_documents,
    sum_sq_cv,
)
from resihp_jax.errors import ConfigError

SYNTHETIC_SPECS = ["synthetic:uniform", "synthetic:lognormal", "synthetic:bimodal"]
SHAPE = {"n_microbatches": 3, "microbatch_size": 2, "seq_len": 64}


def _check_row(tokens_S: np.ndarray, seg_S: np.ndarray, pos_S: np.ndarray, lengths) -> None:
    """Segments 1..k contiguous in order, padding only at the end, positions restart per piece."""
    n_real = int(sum(lengths))
    assert np.all(seg_S[n_real:] == 0) and np.all(tokens_S[n_real:] == 0)
    expected_seg = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    np.testing.assert_array_equal(seg_S[:n_real], expected_seg)
    expected_pos = np.concatenate([np.arange(n) for n in lengths]) if lengths else []
    np.testing.assert_array_equal(pos_S[:n_real], expected_pos)
    assert all(n > 0 for n in lengths)


def _rows_of(rows: PackedRows):
    return zip(rows.tokens_NxS, rows.segment_ids_NxS, rows.positions_NxS, rows.doc_lengths)


def _batch_rows(batch: GlobalBatch):
    m, b, s = batch.shape
    flat_lengths = [row for mb in batch.doc_lengths for row in mb]
    return zip(
        batch.tokens_MxBxS.reshape(m * b, s),
        batch.segment_ids_MxBxS.reshape(m * b, s),
        batch.positions_MxBxS.reshape(m * b, s),
        flat_lengths,
    )


def _pieces(rows) -> list[np.ndarray]:
    """All pieces in stream order."""
    out = []
    for tokens_S, _, _, lengths in rows:
        starts = np.cumsum([0, *lengths])
        out += [tokens_S[a:b] for a, b in itertools.pairwise(starts)]
    return out


def _stream_tokens(batches: list[GlobalBatch]) -> np.ndarray:
    return np.concatenate([p for b in batches for p in _pieces(_batch_rows(b))])


def _assert_same(a: GlobalBatch, b: GlobalBatch) -> None:
    np.testing.assert_array_equal(a.tokens_MxBxS, b.tokens_MxBxS)
    np.testing.assert_array_equal(a.segment_ids_MxBxS, b.segment_ids_MxBxS)
    np.testing.assert_array_equal(a.positions_MxBxS, b.positions_MxBxS)
    assert a.doc_lengths == b.doc_lengths


# ---------- packing ----------


def test_pack_documents_keeps_every_token_and_boundary() -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, n).astype(np.int32) for n in [5, 40, 1, 16, 33, 7, 0, 64, 3]]
    rows = pack_documents(docs, seq_len=16)
    assert rows.tokens_NxS.dtype == rows.segment_ids_NxS.dtype == np.int32
    for row in _rows_of(rows):
        _check_row(*row)
    assert all(sum(r) == 16 for r in rows.doc_lengths[:-1])  # only the last row may pad
    pieces, rebuilt = _pieces(_rows_of(rows)), []
    for doc in (d for d in docs if d.size):  # pieces regroup into the documents, in order
        parts = []
        while sum(p.size for p in parts) < doc.size:
            parts.append(pieces.pop(0))
        rebuilt.append(np.concatenate(parts))
    assert not pieces
    for doc, got in zip((d for d in docs if d.size), rebuilt):
        np.testing.assert_array_equal(doc, got)


def test_global_batch_loss_tokens_and_sum_sq() -> None:
    rows = pack_documents([np.arange(3), np.arange(6), np.arange(2)], seq_len=4)
    assert rows.doc_lengths == ((3, 1), (4,), (1, 2))  # the last row ends in one pad token
    batch = GlobalBatch.from_rows(rows, n_microbatches=3)
    assert batch.shape == (3, 1, 4)
    np.testing.assert_array_equal(batch.sum_sq_lengths(), [9 + 1, 16, 1 + 4])
    assert batch.sum_sq_lengths().dtype == np.float64
    with pytest.raises(ConfigError, match="n_microbatches=2"):
        GlobalBatch.from_rows(rows, n_microbatches=2)


# ---------- iterator: shape, content, determinism, resume ----------


@pytest.mark.parametrize("spec", SYNTHETIC_SPECS)
def test_iterator_batches_are_full_and_follow_the_documents(spec: str) -> None:
    it = BatchIterator(spec, seed=3, **SHAPE)
    batches = [it.next_batch() for _ in range(4)]
    for batch in batches:
        assert batch.shape == (3, 2, 64) and batch.tokens_MxBxS.dtype == np.int32
        assert len(batch.doc_lengths) == 3 and all(len(mb) == 2 for mb in batch.doc_lengths)
        for row in _batch_rows(batch):
            _check_row(*row)
            assert sum(row[3]) == 64  # an endless source never pads
    source = SyntheticSource(spec.split(":")[1], seed=3, seq_len=64)
    stream = _stream_tokens(batches)
    docs = np.concatenate([source.item(0, i) for i in range(stream.size // 8 + 2)])
    np.testing.assert_array_equal(stream, docs[: stream.size])


def test_synthetic_content_is_learnable_motifs() -> None:
    source = SyntheticSource("uniform", seed=0, seq_len=512)
    for i in range(20):
        doc = source.item(0, i)
        assert doc.min() >= ord("a") and doc.max() <= ord("z")
        best_match = max(np.mean(doc[p:] == doc[:-p]) for p in range(2, 17))
        assert best_match > 0.8


@pytest.mark.parametrize("spec", SYNTHETIC_SPECS)
def test_same_seed_same_batches_different_seed_differs(spec: str) -> None:
    a, b, c = (BatchIterator(spec, seed=s, **SHAPE) for s in (7, 7, 8))
    for _ in range(3):
        batch_a, batch_c = a.next_batch(), c.next_batch()
        _assert_same(batch_a, b.next_batch())
    assert not np.array_equal(batch_a.tokens_MxBxS, batch_c.tokens_MxBxS)


def _resume_check(spec: str, k: int = 3, n: int = 4) -> None:
    reference = BatchIterator(spec, seed=1, **SHAPE)
    expected = [reference.next_batch() for _ in range(k + n)]
    first = BatchIterator(spec, seed=1, **SHAPE)
    for _ in range(k):
        first.next_batch()
    saved = json.loads(json.dumps(first.state()))
    resumed = BatchIterator(spec, seed=1, state=saved, **SHAPE)
    restored = BatchIterator(spec, seed=1, **SHAPE)
    restored.restore(saved)
    for want in expected[k:]:
        _assert_same(resumed.next_batch(), want)
        _assert_same(restored.next_batch(), want)
    assert resumed.batches_served == k + n


@pytest.mark.parametrize("spec", SYNTHETIC_SPECS)
def test_resume_is_exact(spec: str) -> None:
    _resume_check(spec)


def test_state_is_small_and_json() -> None:
    it = BatchIterator("synthetic:lognormal", seed=0, **SHAPE)
    it.next_batch()
    state = it.state()
    assert json.loads(json.dumps(state)) == state
    assert len(json.dumps(state)) < 400


# ---------- length distributions ----------


def _lengths(name: str, seq_len: int = 512, n: int = 3000) -> np.ndarray:
    source = SyntheticSource(name, seed=0, seq_len=seq_len)
    return np.array([source.item_size(0, i) for i in range(n)])


def test_uniform_lengths_are_flat() -> None:
    lengths_N = _lengths("uniform")
    assert lengths_N.min() >= 16 and lengths_N.max() <= 512
    counts, _ = np.histogram(lengths_N, bins=4, range=(16, 513))
    assert counts.min() > 0.8 * counts.max()


def test_lognormal_lengths_have_a_long_tail() -> None:
    lengths_N = _lengths("lognormal")
    stats = length_summary(lengths_N)
    assert lengths_N.min() >= 8 and lengths_N.max() <= 4 * 512
    assert stats["mean"] > 1.3 * stats["median"]
    assert stats["p99"] > 5 * stats["median"]


def test_bimodal_lengths_have_two_modes() -> None:
    lengths_N = _lengths("bimodal")
    short, long = lengths_N <= 512 // 8, lengths_N >= 512 // 2
    assert np.all(short | long)  # nothing in the gap between the modes
    assert 0.6 < short.mean() < 0.9 and long.mean() > 0.1


def test_length_statistics_helpers() -> None:
    assert coefficient_of_variation([2.0, 2.0, 2.0]) == 0.0
    assert coefficient_of_variation([]) == 0.0
    assert coefficient_of_variation([1.0, 3.0]) == pytest.approx(0.5)
    it = BatchIterator("synthetic:bimodal", seed=0, **SHAPE)
    cv = sum_sq_cv(it.next_batch().sum_sq_lengths() for _ in range(5))
    assert cv > 0


# ---------- corpus ----------


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    texts = {
        "a.txt": "alpha document\n",
        "b.txt": "bravo " * 30,
        "sub/c.md": "charlie in a nested dir",
        "sub/deeper/d.py": "print('delta')\n" * 5,
        "sub/e.txt": "echo",
        "f.txt": "foxtrot, with some unicode: \u00e9\u00e8\n",
    }
    for rel, text in texts.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / ".hidden.txt").write_text("hidden")
    return tmp_path


def test_corpus_reads_text_files_in_seeded_epoch_order(corpus_dir: Path) -> None:
    source = CorpusSource(corpus_dir, seed=5)
    names = [f.rel_path for f in source.files]
    assert names == sorted(names) and "sub/deeper/d.py" in names
    assert ".hidden.txt" not in names and "empty.txt" not in names
    assert "blob.bin" not in names  # binary: left out when indexed
    it = BatchIterator(source, seed=5, n_microbatches=2, microbatch_size=2, seq_len=32)
    stream = _stream_tokens([it.next_batch() for _ in range(8)])
    expected = []
    for epoch in range(4):
        for index in range(source.items_per_epoch()):
            expected.append(source.item(epoch, index))
    expected_N = np.concatenate(expected)
    assert stream.size > expected_N.size // 2  # the batches ran through several epochs
    np.testing.assert_array_equal(stream, expected_N[: stream.size])
    orders = [tuple(source.order(e)) for e in range(4)]
    assert len(set(orders)) > 1 and sorted(orders[0]) == list(range(len(names)))


def test_corpus_that_changes_during_a_run_is_named(corpus_dir: Path) -> None:
    it = BatchIterator(f"corpus:{corpus_dir}", seed=0, n_microbatches=1, microbatch_size=8,
                       seq_len=32)
    batch = it.next_batch()  # laid out from the indexed sizes
    (corpus_dir / "a.txt").write_text("longer than it was when indexed\n")
    with pytest.raises(ConfigError, match="a.txt.*indexed with 15 bytes"):
        batch.microbatch_tokens(0)


class CountingSource:
    """A source that counts the items whose tokens were read."""

    def __init__(self, inner) -> None:
        self.inner, self.reads = inner, []
        self.spec, self.max_doc_len = inner.spec, inner.max_doc_len

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def item(self, epoch: int, index: int) -> np.ndarray:
        self.reads.append(index)
        return self.inner.item(epoch, index)


def test_batches_are_laid_out_without_reading_and_read_per_microbatch() -> None:
    source = CountingSource(SyntheticSource("lognormal", seed=2, seq_len=64))
    it = BatchIterator(source, seed=2, **SHAPE)
    batch = it.next_batch()
    assert source.reads == []  # lengths, segment ids and positions need no tokens
    assert batch.sum_sq_lengths().shape == (3,) and batch.segment_ids_MxBxS.any()
    tokens_BxS = batch.microbatch_tokens(1)
    read_for_1 = set(source.reads)
    eager = BatchIterator("synthetic:lognormal", seed=2, **SHAPE).next_batch()
    np.testing.assert_array_equal(tokens_BxS, eager.tokens_MxBxS[1])
    _assert_same(batch, eager)  # reads the whole batch
    assert read_for_1 and read_for_1 < set(source.reads)  # the others' documents were not read
    assert batch.content_crc == eager.content_crc != it.next_batch().content_crc


def test_corpus_resume_across_epochs(corpus_dir: Path) -> None:
    _resume_check(f"corpus:{corpus_dir}", k=5, n=6)


def test_corpus_splits_long_files_at_max_doc_len(corpus_dir: Path) -> None:
    source = CorpusSource(corpus_dir, seed=0, max_doc_len=7)
    it = BatchIterator(source, seed=0, n_microbatches=1, microbatch_size=4, seq_len=16)
    batch = it.next_batch()
    assert max(n for row in batch.doc_lengths[0] for n in row) <= 7


def test_default_stdlib_corpus_gives_batches() -> None:
    it = BatchIterator("corpus", seed=0, n_microbatches=2, microbatch_size=2, seq_len=128)
    for _ in range(2):
        batch = it.next_batch()
        assert 0 <= batch.tokens_MxBxS.min() and batch.tokens_MxBxS.max() < 256
        assert batch.segment_ids_MxBxS.any()
    state = it.state()
    assert state["source"] == "corpus" and state["fingerprint"]
    _assert_same(
        BatchIterator(
            "corpus", seed=0, n_microbatches=2, microbatch_size=2, seq_len=128, state=state
        ).next_batch(),
        it.next_batch(),
    )


# ---------- errors ----------


def test_bad_spec_lists_valid_specs() -> None:
    for spec in ["synthetic:zipf", "synthetic", "", "files:/x", "corpus:"]:
        with pytest.raises(ConfigError, match="synthetic:lognormal"):
            make_source(spec, seed=0, seq_len=64)


def test_corpus_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        make_source(f"corpus:{tmp_path / 'missing'}", seed=0, seq_len=64)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no usable"):
        make_source(f"corpus:{tmp_path / 'empty'}", seed=0, seq_len=64)
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "x.bin").write_bytes(b"\x00\x01\x02")
    (tmp_path / "binary" / "y.txt").write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(ConfigError, match="no usable"):
        make_source(f"corpus:{tmp_path / 'binary'}", seed=0, seq_len=64)


@pytest.mark.parametrize("key", ["n_microbatches", "microbatch_size", "seq_len"])
@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_non_positive_sizes_are_rejected(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        BatchIterator("synthetic:uniform", seed=0, **{**SHAPE, key: value})


def test_negative_seed_is_rejected() -> None:
    with pytest.raises(ConfigError, match="seed"):
        BatchIterator("synthetic:uniform", seed=-1, **SHAPE)


def _saved_state() -> dict:
    it = BatchIterator("synthetic:uniform", seed=0, **SHAPE)
    it.next_batch()
    return it.state()


@pytest.mark.parametrize(
    ("spec", "seed", "shape", "match"),
    [
        ("synthetic:bimodal", 0, SHAPE, "source"),
        ("synthetic:uniform", 1, SHAPE, "seed"),
        ("synthetic:uniform", 0, {**SHAPE, "seq_len": 32}, "seq_len"),
        ("synthetic:uniform", 0, {**SHAPE, "microbatch_size": 4}, "microbatch_size"),
    ],
)
def test_state_mismatch_is_named(spec: str, seed: int, shape: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        BatchIterator(spec, seed=seed, state=_saved_state(), **shape)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s.pop("offset"), "missing"),
        (lambda s: s.update(offset=-1), "offset"),
        (lambda s: s.update(offset=10**6), "offset"),
        (lambda s: s.update(epoch=2), "epoch"),
        (lambda s: s.update(index="3"), "index"),
        (lambda s: s.update(version=99), "version"),
    ],
)
def test_bad_state_is_rejected(edit, match: str) -> None:
    state = _saved_state()
    edit(state)
    with pytest.raises(ConfigError, match=match):
        BatchIterator("synthetic:uniform", seed=0, state=state, **SHAPE)
    with pytest.raises(ConfigError, match="dict"):
        BatchIterator("synthetic:uniform", seed=0, state=[1, 2], **SHAPE)


def test_corpus_state_rejects_changed_corpus(corpus_dir: Path) -> None:
    spec = f"corpus:{corpus_dir}"
    it = BatchIterator(spec, seed=0, **SHAPE)
    it.next_batch()
    state = it.state()
    (corpus_dir / "new.txt").write_text("a new file")
    with pytest.raises(ConfigError, match="fingerprint"):
        BatchIterator(spec, seed=0, state=state, **SHAPE)
