"""speed: mfu.py's comparison (our `preset_programs`: `rh.models.Llama` through the one step
builder every model trains through, `rh.fit`'s, against the plain-JAX peer with cuDNN
attention) for llama-1b at 4 x 2048 rows, 1 x 8192 rows of a few long documents, and
32,768 tokens per step (16 x 2048): tokens/s, ours/peer ratio and MFU of each."""

from __future__ import annotations

import time
import zlib
from typing import Any

import jax
import numpy as np

from benchmarks import mfu
from benchmarks.gpu_sections.common import Pair, Suite, first_line, print_table
from resihp_jax.data import BatchIterator, GlobalBatch

MAX_LONG_DOCS = 8


def long_documents(rows: int, seq_len: int, seed: int, n_docs: int = 6) -> GlobalBatch:
    """`rows` rows of `n_docs` (<= 8) long documents each, tokens from the synthetic source."""
    rng = np.random.default_rng(seed)
    tokens_MxBxS = BatchIterator("synthetic:lognormal", n_microbatches=1, microbatch_size=rows,
                                 seq_len=seq_len, seed=seed).next_batch().tokens_MxBxS
    lengths = []
    for _ in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, seq_len), n_docs - 1, replace=False))
        lengths.append(tuple(int(n) for n in np.diff(np.concatenate([[0], cuts, [seq_len]]))))
    crc = zlib.crc32(np.ascontiguousarray(tokens_MxBxS).tobytes())
    return GlobalBatch.from_layout(tuple(lengths), 1, seq_len, lambda m: tokens_MxBxS[m], crc)


def measure_pair(pair: Pair, warmup: int, rounds: int) -> dict[str, list[float]]:
    """Per-step seconds of ours and the peer, in turn every round; states kept in the pair."""
    pair.advance("ours", warmup)
    pair.advance("peer", warmup)
    samples: dict[str, list[float]] = {"ours": [], "peer": []}
    for _ in range(rounds):
        for name in samples:
            start = time.perf_counter()
            pair.advance(name, 1)
            samples[name].append(time.perf_counter() - start)
    return samples


def configs(quick: bool) -> list[tuple[str, int, int, bool]]:
    """(name, rows, seq_len, long documents)."""
    if quick:  # the 32k row runs the same code as the first: left out (compiles are the time)
        return [("4x64", 4, 64, False), ("1x128 long docs", 1, 128, True)]
    return [("4x2048", 4, 2048, False), ("1x8192 long docs", 1, 8192, True),
            ("16x2048 (32768 tokens)", 16, 2048, False)]


def one_config(suite: Suite, name: str, rows: int, seq_len: int, long_docs: bool
               ) -> dict[str, Any]:
    batch = long_documents(rows, seq_len, suite.seed) if long_docs else None
    pair = suite.pair(name, rows, seq_len, batch)
    samples = measure_pair(pair, warmup=2, rounds=suite.rounds)
    seg_NxS = pair.batch.segment_ids_MxBxS.reshape(-1, seq_len)
    flops, tokens = mfu.model_flops(pair.model, seg_NxS)
    peak = mfu.peak_flops(suite.device, None)
    result = mfu.report(samples, pair.first_loss, flops, tokens, 1, peak, suite.device,
                        pair.labels)
    result["documents"] = int(len(mfu.document_lengths(seg_NxS)))
    result["cold_start_s"] = {n: c.seconds for n, c in pair.cold.items()}
    return result


def run(suite: Suite) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, rows, seq_len, long_docs in configs(suite.quick):
        print(f"\nspeed: {suite.llama().name} at {name}")
        try:
            results[name] = one_config(suite, name, rows, seq_len, long_docs)
        except Exception as error:  # noqa: BLE001 - an out-of-memory row must not end the rest
            results[name] = {"error": first_line(error)}
            jax.clear_caches()
        # two llama-1b states with Adam take 26 GB: one pair on the device at a time (this
        # section runs after the others that share the 4 x 2048 pair)
        suite.pairs.pop(name, None)
    rows = [{"config": n, "ours tok/s": r.get("tokens_per_s_per_device"),
             "peer tok/s": r.get("peer_tokens_per_s_per_device"), "ours/peer": r.get("ratio"),
             "paired": r.get("ratio_paired_rounds"), "MFU": r.get("mfu"),
             "peer MFU": r.get("peer_mfu"), "docs": r.get("documents"),
             "error": r.get("error")} for n, r in results.items()]
    print_table("speed: ours (preset_programs) / peer (jit + dot_product_attention), medians over "
                f"{suite.rounds} interleaved rounds", rows, list(rows[0]))
    return results
