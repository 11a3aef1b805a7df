"""Your own GPT-2-style Flax NNX model, trained resiliently on a token file (byte tokens of
the Python standard library): python examples/user_model/train_gpt2.py [--steps N]. Hosts:
  resihp launch --procs 2 --devices-per-proc 4 -- python examples/user_model/train_gpt2.py
  srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=4 python examples/user_model/train_gpt2.py"""
import argparse
import pathlib

import jax
import numpy as np
import optax
from flax import nnx

import resihp_jax as rh

P, INIT = nnx.with_partitioning, nnx.initializers.normal(0.02)


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        self.ln1, self.ln2 = (nnx.LayerNorm(d, rngs=rngs) for _ in range(2))
        self.qkv = nnx.Linear(d, 3 * d, kernel_init=P(INIT, ("embed", "heads")), rngs=rngs)
        self.proj = nnx.Linear(d, d, kernel_init=P(INIT, ("heads", "embed")), rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, kernel_init=P(INIT, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(4 * d, d, kernel_init=P(INIT, ("mlp", "embed")), rngs=rngs)

    def __call__(self, h, segment_ids, positions):  # packed documents never see each other
        b, s, d = h.shape
        qkv = self.qkv(self.ln1(h)).reshape(b, s, 3, self.heads, d // self.heads)
        att = rh.nn.segment_attention(*(qkv[:, :, i] for i in range(3)), segment_ids, block_size=32)
        h = h + self.proj(att.reshape(b, s, d))
        return h + self.down(jax.nn.gelu(self.up(self.ln2(h))))

class GPT2(nnx.Module):
    def __init__(self, vocab=256, d=128, heads=4, layers=4, max_len=256, *, rngs: nnx.Rngs):
        self.wte = nnx.Embed(vocab, d, embedding_init=P(INIT, ("vocab", "embed")), rngs=rngs)
        self.wpe = nnx.Embed(max_len, d, embedding_init=INIT, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)

    def embed(self, tokens, positions):
        return self.wte(tokens) + self.wpe(positions)
    def head(self, h):
        return self.wte.attend(self.ln_f(h))  # tied input and output embeddings

if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--steps", type=int, default=20)
    cli.add_argument("--tokens", default="stdlib.tokens", help="written here if missing")
    args = cli.parse_args()
    rh.use_cpu_devices(8)  # no accelerator: 8 fake CPU devices
    tokens = pathlib.Path(args.tokens)
    if not tokens.exists():
        files = sorted(pathlib.Path(argparse.__file__).parent.glob("*.py"))[:200]  # stdlib
        rh.data.write_token_file(tokens, [np.frombuffer(f.read_bytes(), np.uint8) for f in files])
    plan = rh.Plan.uniform(2, 2, 2, n_layers=4, n_microbatches=4, microbatch_size=2, seq_len=256)
    result = rh.fit(lambda rngs: GPT2(rngs=rngs), rh.data.TokenFileSource(tokens),
                    optimizer=optax.adamw(3e-3), plan=plan.replace(layers_per_stage=(1, 3)),
                    steps=args.steps, on_step=lambda r: print(f"step {r.step} loss {r.loss:.3f}"))
    print(f"trained {type(result.model).__name__}; re-plans: {len(result.replans)}")
