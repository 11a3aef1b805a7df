"""`rh.data`: documents -> packed micro-batches through a resumable iterator, from the
library's sources or the user's own data (documents or batches they packed). Pure numpy.
"""

from resihp_jax.data.corpus import CorpusSource, default_corpus_dir, index_files
from resihp_jax.data.iterator import BatchIterator, Cursor, DocumentStream
from resihp_jax.data.lengths import (DISTRIBUTIONS, coefficient_of_variation, get_distribution,
                                     length_summary, sum_sq, sum_sq_cv)
from resihp_jax.data.packing import GlobalBatch, PackedRows, fill_row, pack_documents, pack_rows
from resihp_jax.data.sources import DocumentSource, SyntheticSource, make_source, valid_specs
from resihp_jax.data.token_file import TokenFileSource, write_token_file
from resihp_jax.data.adapters import from_documents, from_grain, from_hf_dataset
from resihp_jax.data.prepacked import PackedBatch, PackedBatchIterator, packed_batches

__all__ = ["DISTRIBUTIONS", "BatchIterator", "CorpusSource", "Cursor", "DocumentSource",
           "DocumentStream", "GlobalBatch", "PackedBatch", "PackedBatchIterator", "PackedRows",
           "SyntheticSource", "TokenFileSource", "coefficient_of_variation", "default_corpus_dir",
           "fill_row", "from_documents", "from_grain", "from_hf_dataset", "get_distribution",
           "index_files", "length_summary", "make_source", "pack_documents", "pack_rows",
           "packed_batches", "sum_sq", "sum_sq_cv", "valid_specs", "write_token_file"]
