"""Attention cost vs document packing: block-sparse segment attention against the dense baseline.

At a fixed number of tokens per row, rows pack from one document to many short ones; the
block-sparse kernel should cost a + b * sum(l_i^2) while the dense one costs the same for all.
Usage: python benchmarks/attention_cost.py [--quick] [--seq-len S] [--seed N]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from resihp_jax.attention.kernels import computed_block_pairs, dense_attention, segment_attention

EQUAL_DOC_COUNTS = (1, 2, 4, 8, 16, 32)


def equal_docs(seq_len: int, n_docs: int) -> np.ndarray:
    return np.repeat(np.arange(1, n_docs + 1), seq_len // n_docs).astype(np.int32)


def lognormal_docs(seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """Contiguous documents with lognormal lengths, as the packer lays them out."""
    lengths: list[int] = []
    while sum(lengths) < seq_len:
        lengths.append(max(1, int(rng.lognormal(np.log(seq_len / 6), 1.0))))
    lengths[-1] -= sum(lengths) - seq_len
    return np.repeat(np.arange(1, len(lengths) + 1), lengths).astype(np.int32)


def doc_stats(seg_S: np.ndarray) -> tuple[int, int]:
    lengths = np.bincount(seg_S)[1:]
    lengths = lengths[lengths > 0]
    return len(lengths), int(np.sum(lengths.astype(np.int64) ** 2))


def build_functions(block_size: int) -> dict:
    sparse = functools.partial(segment_attention, block_size=block_size)

    def fwd_bwd(attn):
        return jax.grad(lambda q, k, v, seg: jnp.sum(attn(q, k, v, seg)), (0, 1, 2))

    return {"sparse": jax.jit(sparse), "dense": jax.jit(dense_attention),
            "sparse_fb": jax.jit(fwd_bwd(sparse)), "dense_fb": jax.jit(fwd_bwd(dense_attention))}


def time_ms(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) * 1e3


def measure(fns: dict, qkv: tuple, rows: list[np.ndarray], sweeps: int,
            samples_per_sweep: dict) -> dict:
    """Median ms per (function, row). Every sweep times all rows and functions in turn, so
    machine noise that comes and goes hits sparse and dense alike; the cheap sparse calls
    take several samples per sweep, the slow dense baseline one."""
    segs = [jnp.asarray(row[None]) for row in rows]
    for fn in fns.values():  # compile once (segment ids are runtime data) and warm up
        for seg in segs:
            jax.block_until_ready(fn(*qkv, seg))
    samples = {name: [[] for _ in rows] for name in fns}
    for _ in range(sweeps):
        for i, seg in enumerate(segs):
            for name, fn in fns.items():
                samples[name][i] += [time_ms(fn, *qkv, seg)
                                     for _ in range(samples_per_sweep[name])]
    return {name: [float(np.median(s)) for s in per_row] for name, per_row in samples.items()}


def linear_fit_r2(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least squares y = a + b x; returns (a, b, R^2)."""
    design = np.stack([np.ones_like(x), x], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = y - (a + b * x)
    return float(a), float(b), float(1 - residual @ residual / np.sum((y - y.mean()) ** 2))


def print_table(rows, stats, pairs, ms) -> None:
    print(f"{'n_docs':>6} {'sum_l2':>10} {'pairs':>5} {'sparse_ms':>9} {'dense_ms':>9} "
          f"{'ratio':>6} {'sparse_fb_ms':>12} {'dense_fb_ms':>11} {'ratio_fb':>8}")
    for i in range(len(rows)):
        n_docs, sum_l2 = stats[i]
        fwd = (ms["sparse"][i], ms["dense"][i])
        fb = (ms["sparse_fb"][i], ms["dense_fb"][i])
        print(f"{n_docs:>6} {sum_l2:>10} {pairs[i]:>5} {fwd[0]:>9.2f} {fwd[1]:>9.2f} "
              f"{fwd[1] / fwd[0]:>6.1f} {fb[0]:>12.2f} {fb[1]:>11.2f} {fb[1] / fb[0]:>8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller rows, fewer repeats")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    seq_len = args.seq_len or (1024 if args.quick else 2048)
    block = args.block_size or (64 if args.quick else 128)
    heads, head_dim, sweeps = 4, 64, (3 if args.quick else 5)

    rng = np.random.default_rng(args.seed)
    rows = [equal_docs(seq_len, n) for n in EQUAL_DOC_COUNTS]
    rows += [lognormal_docs(seq_len, rng) for _ in range(3)]
    keys = jax.random.split(jax.random.key(args.seed), 3)
    qkv = tuple(jax.random.normal(key, (1, seq_len, heads, head_dim)) for key in keys)

    print(f"S={seq_len} block={block} H=G={heads} K={head_dim} rows=1 sweeps={sweeps} "
          f"devices={jax.device_count()} ({jax.devices()[0].platform})")
    print("No faults are involved: healthy devices, this measures the attention kernel only.")
    per_sweep = {"sparse": 3, "sparse_fb": 3, "dense": 1, "dense_fb": 1}
    ms = measure(build_functions(block), qkv, rows, sweeps, per_sweep)
    stats = [doc_stats(row) for row in rows]
    pairs = [computed_block_pairs(row[None], block) for row in rows]
    print_table(rows, stats, pairs, ms)

    sum_l2 = np.array([s[1] for s in stats], np.float64)
    a, b, r2 = linear_fit_r2(sum_l2, np.array(ms["sparse"]))
    a_fb, b_fb, r2_fb = linear_fit_r2(sum_l2, np.array(ms["sparse_fb"]))
    r2_dense = linear_fit_r2(sum_l2, np.array(ms["dense"]))[2]
    r2_pairs = linear_fit_r2(np.array(pairs, np.float64), np.array(ms["sparse"]))[2]
    print(f"fit fwd:     ms = {a:.3f} + {b * 1e6:.3f}e-6 * sum_l2   R^2 = {r2:.4f}")
    print(f"fit fwd+bwd: ms = {a_fb:.3f} + {b_fb * 1e6:.3f}e-6 * sum_l2   R^2 = {r2_fb:.4f}")
    print(f"dense fwd vs sum_l2: R^2 = {r2_dense:.4f} (flat: cost ignores the packing)")
    print(f"sparse fwd vs computed block pairs: R^2 = {r2_pairs:.4f}")
    at32 = EQUAL_DOC_COUNTS.index(32)
    print(json.dumps({
        "r2": round(r2, 4), "r2_fwd_bwd": round(r2_fb, 4),
        "r2_fwd_vs_block_pairs": round(r2_pairs, 4),
        "speedup_vs_dense_at_32_docs": round(ms["dense"][at32] / ms["sparse"][at32], 2),
        "speedup_fwd_bwd_vs_dense_at_32_docs":
            round(ms["dense_fb"][at32] / ms["sparse_fb"][at32], 2),
        "speedup_vs_dense_at_1_doc": round(ms["dense"][0] / ms["sparse"][0], 2),
        "fit_fwd_ms": [round(a, 4), b], "fit_fwd_bwd_ms": [round(a_fb, 4), b_fb],
        "seq_len": seq_len, "block_size": block, "faults": "none"}))


if __name__ == "__main__":
    main()
