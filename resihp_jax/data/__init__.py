"""Documents -> packed micro-batches: length distributions, sources, packing, resumable iterator.

Pure numpy; nothing here needs JAX.
"""

from resihp_jax.data.corpus import CorpusSource, default_corpus_dir, index_files
from resihp_jax.data.iterator import BatchIterator, Cursor, DocumentStream
from resihp_jax.data.lengths import (
    DISTRIBUTIONS,
    coefficient_of_variation,
    get_distribution,
    length_summary,
    sum_sq,
    sum_sq_cv,
)
from resihp_jax.data.packing import GlobalBatch, PackedRows, fill_row, pack_documents, pack_rows
from resihp_jax.data.sources import DocumentSource, SyntheticSource, make_source, valid_specs

__all__ = [
    "DISTRIBUTIONS",
    "BatchIterator",
    "CorpusSource",
    "Cursor",
    "DocumentSource",
    "DocumentStream",
    "GlobalBatch",
    "PackedRows",
    "SyntheticSource",
    "coefficient_of_variation",
    "default_corpus_dir",
    "fill_row",
    "get_distribution",
    "index_files",
    "length_summary",
    "make_source",
    "pack_documents",
    "pack_rows",
    "sum_sq",
    "sum_sq_cv",
    "valid_specs",
]
