"""The user's own documents as document sources for `BatchIterator`, which packs them.

`from_hf_dataset` and `from_grain` take any map-style dataset (`len(ds)`, `ds[i]`), duck-typed
so neither package is imported. Every epoch visits the documents in the given order. A
fingerprint names the content so a saved position is never restored into other data: over
every token for `from_documents`, over a few sampled records for the adapters.
"""

import hashlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from resihp_jax.errors import ConfigError

MAX_TOKEN_ID = int(np.iinfo(np.int32).max)
FINGERPRINT_SAMPLES = 16  # records an adapter's fingerprint reads


def as_document(tokens: Any, where: str) -> np.ndarray:
    """int32 [L]: one document's token ids; ConfigError naming `where` unless they are a
    1-D array of integers in 0 .. MAX_TOKEN_ID."""
    if isinstance(tokens, str | bytes):  # a dataset's text column, for one
        raise ConfigError(f"{where} holds text ({tokens[:24]!r}), not token ids: tokenize it "
                          "first (a list or array of integer ids)")
    try:
        array_L = np.asarray(tokens)
    except (TypeError, ValueError) as err:  # ragged nested lists, for one
        raise ConfigError(f"{where} must be a 1-D array of token ids: {err}") from None
    if array_L.ndim != 1:
        raise ConfigError(f"{where} must be a 1-D array of token ids, got shape {array_L.shape}")
    if array_L.size == 0:
        return np.zeros(0, np.int32)  # an empty list is float64 to numpy; its dtype is moot
    if not np.issubdtype(array_L.dtype, np.integer):
        raise ConfigError(f"{where} must hold integer token ids, got dtype {array_L.dtype}")
    bad_L = (array_L < 0) | (array_L > MAX_TOKEN_ID)
    if bad_L.any():
        column = int(np.argmax(bad_L))
        raise ConfigError(f"{where} holds token id {int(array_L[column])} at position {column}; "
                          f"valid ids are 0 .. {MAX_TOKEN_ID}")
    return array_L.astype(np.int32)


def checked_documents(docs: Any, what: str) -> list[np.ndarray]:
    """`docs` (a sequence of token arrays) as int32 documents; ConfigError naming `what`
    unless they are valid and hold at least one token."""
    n = check_map_style(docs, what)
    checked = [as_document(docs[i], f"document {i}") for i in range(n)]
    if not any(doc_L.size for doc_L in checked):
        raise ConfigError(f"{what} got {n} documents, all empty; it needs at least one token")
    return checked


def documents_digest(docs: Iterable[np.ndarray]) -> str:
    """Hex digest of int32 documents: each one's length then its tokens, so equal documents
    give equal digests however they were stored."""
    digest = hashlib.blake2b(digest_size=8)
    for doc_L in docs:
        digest.update(np.int64(doc_L.size).tobytes())
        digest.update(np.ascontiguousarray(doc_L, dtype="<i4").tobytes())
    return digest.hexdigest()


LIST_HINT = "pass a list of its records (list(data))"


def check_map_style(data: Any, what: str, hint: str = LIST_HINT) -> int:
    """len(data); ConfigError unless `data` is a non-empty, finite map-style dataset (len and
    [i]). `hint` says what to pass instead of an object without them."""
    if isinstance(data, Mapping):  # a DatasetDict, or a dict of columns: no record [i]
        keys = sorted(map(str, data))[:8]
        raise ConfigError(
            f"{what} needs a map-style dataset with len() and [i], got a {type(data).__name__} "
            f"with keys {keys}; pass one split (data['train']) or a list of records")
    if isinstance(data, str | bytes) or not (
            hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise ConfigError(f"{what} needs a map-style dataset with len() and [i], got "
                          f"{type(data).__name__}; {hint}")
    n = len(data)
    if n == 0:
        raise ConfigError(f"{what} got an empty dataset; it needs at least one document")
    if n >= sys.maxsize:  # Grain's MapDataset.repeat() without num_epochs
        raise ConfigError(f"{what} got a dataset without end (len {n}); drop its .repeat(): "
                          "the batch iterator starts the next epoch itself")
    return n


class _Documents:
    """A DocumentSource whose item i of every epoch is `document(i)`, of `_n` documents."""

    max_doc_len: int | None = None
    _n: int
    _fingerprint: str

    def document(self, index: int) -> np.ndarray:
        raise NotImplementedError

    def items_per_epoch(self) -> int:
        return self._n

    def item_size(self, epoch: int, index: int) -> int:
        return int(self.document(index).size)

    def item(self, epoch: int, index: int) -> np.ndarray:
        return self.document(index)

    def fingerprint(self) -> str:
        return self._fingerprint


class DocumentsSource(_Documents):
    """In-memory documents; item i of every epoch is document i."""

    def __init__(self, docs: list[np.ndarray], spec: str = "documents") -> None:
        self.docs, self.spec, self._n = docs, spec, len(docs)
        self._fingerprint = f"{len(docs)}:{documents_digest(docs)}"

    def document(self, index: int) -> np.ndarray:
        return self.docs[index]


def from_documents(docs: Any) -> DocumentsSource:
    """A DocumentSource over a sequence of 1-D integer token arrays (copied, so later edits
    of the arrays cannot change a running job's data); `BatchIterator(from_documents(docs),
    ...)` packs them."""
    return DocumentsSource(checked_documents(docs, "from_documents"))


# record, index -> the record's tokens (anything as_document accepts)
TokensOf = Callable[[Any, int], Any]


class RecordSource(_Documents):
    """A map-style dataset's records as documents; item i of every epoch is record i, read
    when asked (laying a batch out reads each of its records to learn its length; to read
    only a host's own micro-batches, convert the dataset with write_token_file)."""

    def __init__(self, records: Any, tokens_of: TokensOf, spec: str,
                 hint: str = LIST_HINT) -> None:
        self.records = records
        self.spec = spec
        self._tokens_of = tokens_of
        self._n = check_map_style(records, spec, hint)
        self._fingerprint = self._sampled_fingerprint()

    def document(self, index: int) -> np.ndarray:
        """int32 tokens of record `index` (ConfigError naming it if they are not tokens)."""
        tokens = self._tokens_of(self.records[index], index)
        return as_document(tokens, f"{self.spec} record {index}")

    def _sampled_fingerprint(self) -> str:
        # hashing every record would read the whole dataset on every process; a few records
        # spread over it (and the count) tell different datasets apart in practice
        indices = np.unique(np.linspace(0, self._n - 1, min(self._n, FINGERPRINT_SAMPLES),
                                        dtype=np.int64))
        digest = documents_digest([indices.astype(np.int32),
                                   *(self.document(int(i)) for i in indices)])
        return f"{self._n}:sampled:{digest}"


def _field(key: str, what: str) -> TokensOf:
    """record, index -> record[key]; ConfigError naming the record and its keys otherwise."""

    def tokens_of(record: Any, index: int) -> Any:
        if not isinstance(record, Mapping) or key not in record:
            keys = sorted(record) if isinstance(record, Mapping) else type(record).__name__
            raise ConfigError(f"{what} record {index} has no column {key!r}; it has {keys}")
        return record[key]

    return tokens_of


HF_HINT = ("pass a datasets.Dataset (load it without streaming=True), or write the tokens "
           "once with rh.data.write_token_file and train on the TokenFileSource")
GRAIN_HINT = ("pass the grain.MapDataset (before .to_iter_dataset() or .batch()) or a "
              "RandomAccessDataSource")


def from_hf_dataset(ds: Any, column: str = "input_ids") -> RecordSource:
    """A DocumentSource over a map-style Hugging Face dataset (rows are dicts) whose `column`
    holds each row's token ids, e.g. a tokenized `datasets.Dataset` (`.with_format("numpy")`
    makes reading a row cheaper)."""
    spec = f"hf_dataset:{column}"
    return RecordSource(ds, _field(column, spec), spec, HF_HINT)


def _grain_tokens(key: str | None, spec: str) -> TokensOf:
    """record, index -> its tokens: the record itself, or its `key`; a record that a grain
    MapDataset.filter() dropped reads as None and counts as an empty document."""
    field = None if key is None else _field(key, spec)

    def tokens_of(record: Any, index: int) -> Any:
        if record is None:
            return np.zeros(0, np.int32)
        return record if field is None else field(record, index)

    return tokens_of


def from_grain(source: Any, key: str | None = None) -> RecordSource:
    """A DocumentSource over a Grain `MapDataset` or `RandomAccessDataSource` (or any object
    with len() and [i]) whose records are token id arrays, or dicts holding them under `key`.
    A record a `.filter()` dropped (None) counts as an empty document."""
    spec = "grain" if key is None else f"grain:{key}"
    return RecordSource(source, _grain_tokens(key, spec), spec, GRAIN_HINT)
