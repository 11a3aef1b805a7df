"""kernels: the fused Pallas attention (`segment_attention(..., implementation="pallas")`)
against a float32 masked softmax (`dense_attention` on the same values in float32, matmuls at
full precision), in float32 and bf16, head dims 64 and 128, grouped KV heads and not, every
block size the library may pick, rows of 2,048 and 8,192 tokens. Per row: relative errors of
the output and of dq, dk, dv; padding outputs (must be exactly 0); the largest change of any
other document's output when one document's keys and values change (must be exactly 0); and
forward+backward milliseconds against `jax.nn.dot_product_attention` (cuDNN where it
compiles, else XLA) on the same rows, with the segment mask and is_causal as mfu.py's peer.
The candidates `thd` (cuDNN's packed layout, attention/cudnn.py; bf16 only) and `tkx`
(tokamax's Mosaic GPU, Triton or XLA kernel given each token's document start,
attention/tokamax.py; where the optional package is importable) get the same checks and their
own times where they run; where one does not, the row says why."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import mfu
from benchmarks.attention_cost import lognormal_docs
from benchmarks.gpu_sections.common import Suite, first_line, interleaved, median_ms, print_table
from resihp_jax.attention import tokamax
from resihp_jax.attention.cudnn import documents_per_row, packed_attention
from resihp_jax.attention.kernels import dense_attention, segment_attention
from resihp_jax.attention.check import select_kernel

# the llama presets' attn_block (128) and the smaller tiles a fitted block may come down to
GPU_BLOCKS = (32, 64, 128)
TOLERANCE = {"float32": 2e-3, "bfloat16": 3e-2}  # float32: TF32 matmuls in Triton


@dataclass(frozen=True)
class Case:
    dtype: str
    head_dim: int
    heads: int
    kv_heads: int
    seq_len: int
    rows: int
    block: int

    @property
    def name(self) -> str:
        return (f"{'f32' if self.dtype == 'float32' else 'bf16'} d{self.head_dim} "
                f"{self.heads}/{self.kv_heads} {self.rows}x{self.seq_len} b{self.block}")


def cases(quick: bool) -> list[Case]:
    if quick:  # interpreted on CPU: tiny rows, a few of each kind
        return [Case("float32", 64, 4, 4, 64, 2, 16), Case("bfloat16", 128, 4, 2, 64, 2, 32)]
    # every value of each axis, not their product: each configuration costs its compiles
    gqa, mha = (32, 4), (32, 32)
    found = [Case("float32", d, *gqa, 2048, 4, 128) for d in (64, 128)]
    found += [Case("bfloat16", d, *heads, 2048, 4, 128) for d, heads in
              ((64, gqa), (128, gqa), (128, mha))]
    found += [Case("bfloat16", 128, *gqa, 2048, 4, b) for b in GPU_BLOCKS if b != 128]
    found += [Case("bfloat16", 128, *heads, 8192, 1, 128) for heads in (gqa, mha)]
    return found


def chosen_cases(suite: Suite) -> list[Case]:
    """The cases --kernel-cases names (checked against `cases` as it is parsed), else all."""
    every = cases(suite.quick)
    return [c for c in every if c.name in suite.kernel_cases] if suite.kernel_cases else every


def packed_rows(rows: int, seq_len: int, seed: int) -> np.ndarray:
    """[rows, S] lognormal documents, each row ending in padding (1/16 of it)."""
    rng = np.random.default_rng(seed)
    seg = np.stack([lognormal_docs(seq_len, rng) for _ in range(rows)])
    seg[:, seq_len - seq_len // 16:] = 0
    return seg


def chosen_blocks(case: Case) -> str:
    """The kernel and blocks the library runs for this request (blocks that fit the GPU's
    shared memory, or the block-sparse fallback): `select_kernel`, as the step asks it."""
    choice = select_kernel("pallas", platform=jax.default_backend(), seq_len=case.seq_len,
                           block_size=case.block, head_dim=case.head_dim, n_heads=case.heads,
                           n_kv_heads=case.kv_heads, dtype=case.dtype)
    return f"{choice.implementation} {choice.block_q}x{choice.block_k}"


def value_and_grads(attention: Callable, q, k, v, seg, w):
    def loss(q_, k_, v_):
        o = attention(q_, k_, v_, seg)
        return jnp.sum(o.astype(jnp.float32) * w), o

    (_, o), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    return o.astype(jnp.float32), grads


def grouped_dense(q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, seg_BxS):
    """dense_attention one kv head at a time (rematerialized in the backward), so an
    8,192-token row never holds every head's S x S matrix at once."""
    b, s, h, d = q_BxSxHxK.shape
    g = k_BxSxGxK.shape[2]
    q_GxBxSxRxK = q_BxSxHxK.reshape(b, s, g, h // g, d).transpose(2, 0, 1, 3, 4)
    kv = [x.transpose(2, 0, 1, 3)[:, :, :, None] for x in (k_BxSxGxK, v_BxSxGxK)]
    one = jax.checkpoint(lambda a: dense_attention(a[0], a[1], a[2], seg_BxS))
    o_GxBxSxRxK = jax.lax.map(one, (q_GxBxSxRxK, *kv))
    return o_GxBxSxRxK.transpose(1, 2, 0, 3, 4).reshape(b, s, h, d)


def relative_error(got: Any, want: Any) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-6))


def peer_attention(implementation: str) -> Callable:
    return lambda q, k, v, seg: jax.nn.dot_product_attention(
        q, k, v, mask=mfu._segment_mask(seg), is_causal=True, implementation=implementation)


def peer_fwd_bwd(suite: Suite, args: tuple) -> tuple[str, Callable]:
    """The peer's compiled forward+backward: cuDNN where it compiles, else XLA."""
    for implementation in ("cudnn", "xla") if suite.on_gpu else ("xla",):
        fn = jax.jit(functools.partial(value_and_grads, peer_attention(implementation)))
        try:
            fn.lower(*args).compile()
            return implementation, fn
        except Exception as error:  # noqa: BLE001 - a refusal means: try the next one
            print(f"  peer {implementation}: {first_line(error)[:120]}")
    raise RuntimeError("no dot_product_attention implementation compiled")


def checks(fn: Callable, got: tuple, o_ref, grads_ref, args: tuple, doc: np.ndarray, k2, v2,
           dtype: str, prefix: str = "") -> dict[str, Any]:
    """A kernel's row: output and gradient errors against the float32 reference, the
    largest padding output, how far outputs outside `doc` moved when its keys and values
    changed (k2, v2), and `ok` (a NaN anywhere is not ok)."""
    (o, grads), (q, _, _, seg, w) = got, args
    row = {"err_o": relative_error(o, o_ref)}
    row.update({f"err_d{n}": relative_error(a, b) for n, a, b in zip("qkv", grads, grads_ref)})
    row["pad_max"] = float(np.max(np.abs(np.asarray(o)[np.asarray(seg) == 0])))
    o2, _ = fn(q, k2, v2, seg, w)
    row["leak_max"] = float(np.max(np.abs(np.asarray(o2) - np.asarray(o))[~doc]))
    errors = np.array([row[f"err_{f}"] for f in ("o", "dq", "dk", "dv")])
    row["ok"] = bool(np.all(np.isfinite(errors)) and np.all(errors <= TOLERANCE[dtype])
                     and row["pad_max"] == 0 and row["leak_max"] == 0)
    return {f"{prefix}{name}": value for name, value in row.items()}


def packed_candidate(case: Case, args: tuple, o_ref, grads_ref, doc: np.ndarray, k2, v2
                     ) -> tuple[dict[str, Any], Callable | None]:
    """cuDNN's packed (THD) layout, which skips the work between documents: its errors
    against the same float32 reference, padding and leak, and its compiled fwd+bwd (None
    where it does not run: a float32 case, no cuDNN, an older JAX)."""
    if case.dtype == "float32":
        return {"thd": "not for float32"}, None
    bound = int(np.max(np.asarray(documents_per_row(args[3]))))
    kernel = functools.partial(packed_attention, max_documents=bound)
    fn = jax.jit(functools.partial(value_and_grads, kernel))
    try:
        o, grads = fn(*args)
    except Exception as error:  # noqa: BLE001 - a candidate that fails is a row's note
        return {"thd": first_line(error)[:160]}, None
    row = {"thd": f"cudnn packed, {bound} documents a row",
           **checks(fn, (o, grads), o_ref, grads_ref, args, doc, k2, v2, case.dtype, "thd_")}
    return row, fn


def tokamax_candidate(case: Case, args: tuple, o_ref, grads_ref, doc: np.ndarray, k2, v2
                      ) -> tuple[dict[str, Any], Callable | None]:
    """tokamax's kernels (attention/tokamax.py): the same checks, and its compiled fwd+bwd
    (None where the package is missing or no kernel of it takes the case)."""
    why = tokamax.unavailable()
    if why is not None:
        return {"tkx": why[:160]}, None
    fn = jax.jit(functools.partial(value_and_grads, tokamax.document_attention))
    try:
        o, grads = fn(*args)
    except Exception as error:  # noqa: BLE001 - a candidate that fails is a row's note
        return {"tkx": first_line(error)[:160]}, None
    return {"tkx": "tokamax, document starts",
            **checks(fn, (o, grads), o_ref, grads_ref, args, doc, k2, v2, case.dtype,
                     "tkx_")}, fn


def inputs(case: Case, seed: int) -> tuple:
    keys = jax.random.split(jax.random.key(seed), 5)
    b, s = case.rows, case.seq_len
    shapes = [(b, s, case.heads, case.head_dim)] + [(b, s, case.kv_heads, case.head_dim)] * 2
    q, k, v = (jax.random.normal(key, shape).astype(case.dtype)
               for key, shape in zip(keys, shapes))
    w = jax.random.normal(keys[3], shapes[0], jnp.float32)
    return q, k, v, jnp.asarray(packed_rows(b, s, seed)), w, keys[4]


def one_case(suite: Suite, case: Case, rounds: int) -> dict[str, Any]:
    q, k, v, seg, w, key = inputs(case, suite.seed)
    kernel = functools.partial(segment_attention, block_size=case.block,
                               implementation="pallas")
    ours = jax.jit(functools.partial(value_and_grads, kernel))
    o, grads = ours(q, k, v, seg, w)
    with jax.default_matmul_precision("highest"):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        o_ref, grads_ref = jax.jit(functools.partial(value_and_grads, grouped_dense))(
            *f32, seg, w)
    # one document of row 0 gets new keys and values: nothing outside it may move
    seg_np = np.asarray(seg)
    doc = (seg_np == 2) & (np.arange(case.rows) == 0)[:, None]
    doc_k = jnp.asarray(doc)[:, :, None, None]
    k2 = jnp.where(doc_k, jax.random.normal(key, k.shape).astype(k.dtype), k)
    v2 = jnp.where(doc_k, (v.astype(jnp.float32) + 100.0).astype(v.dtype), v)
    row: dict[str, Any] = {"case": case.name, "runs": chosen_blocks(case),
                           **checks(ours, (o, grads), o_ref, grads_ref, (q, k, v, seg, w),
                                    doc, k2, v2, case.dtype)}
    args = (q, k, v, seg, w)
    row["peer"], peer = peer_fwd_bwd(suite, args)
    timed = {"ours": lambda: ours(*args), "peer": lambda: peer(*args)}
    for name, candidate in (("thd", packed_candidate), ("tkx", tokamax_candidate)):
        notes, fn = candidate(case, args, o_ref, grads_ref, doc, k2, v2)
        row.update(notes)
        if fn is not None:
            timed[name] = functools.partial(fn, *args)
    samples = interleaved(timed, warmup=1, rounds=rounds)
    row["ours_ms"], row["peer_ms"] = median_ms(samples["ours"]), median_ms(samples["peer"])
    row["peer_over_ours"] = round(float(np.median(np.asarray(samples["peer"])
                                                  / np.asarray(samples["ours"]))), 4)
    for name in set(timed) & {"thd", "tkx"}:
        row[f"{name}_ms"] = median_ms(samples[name])
        row[f"{name}_over_ours"] = round(float(np.median(np.asarray(samples[name])
                                                          / np.asarray(samples["ours"]))), 4)
    return row


def run(suite: Suite) -> dict[str, Any]:
    interpreted = not suite.on_gpu
    print(f"kernels: Pallas {'interpreted (no GPU)' if interpreted else 'compiled (Triton)'}; "
          f"reference dense_attention in float32 at full matmul precision")
    rows = []
    for case in chosen_cases(suite):
        try:
            rows.append(one_case(suite, case, rounds=3 if suite.quick else 10))
        except Exception as error:  # noqa: BLE001 - a configuration that fails is a row
            rows.append({"case": case.name, "error": first_line(error)})
        print(f"  {rows[-1]}")
    columns = ["case", "runs", "err_o", "err_dq", "err_dk", "err_dv", "pad_max", "leak_max",
               "ok", "ours_ms", "peer", "peer_ms", "peer_over_ours", "thd_ok", "thd_ms",
               "thd_over_ours", "tkx_ok", "tkx_ms", "tkx_over_ours", "error"]
    print_table("kernels: fused attention vs float32 masked softmax; fwd+bwd ms vs "
                "jax.nn.dot_product_attention (peer/ours > 1: ours faster)", rows, columns)
    failed = [r["case"] for r in rows if "error" in r]
    return {"rows": rows, "interpreted": interpreted, "all_ok": all(r.get("ok") for r in rows),
            "failed_to_run": failed}
