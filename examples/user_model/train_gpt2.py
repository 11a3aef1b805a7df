"""A GPT-2-style Flax NNX model written as you write your own, trained resiliently on a token
file (byte tokens of the Python standard library):
  python examples/user_model/train_gpt2.py [--steps N]. Hosts:
  resihp launch --procs 2 --devices-per-proc 4 -- python examples/user_model/train_gpt2.py
  srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=4 python examples/user_model/train_gpt2.py"""
import argparse
import pathlib

import numpy as np
import optax

import resihp_jax as rh

# Your own model: any NNX module with embed(tokens, positions), blocks (identical, each
# block(h, segment_ids, positions)) and head(h), its kernels named with nnx.with_partitioning.
# This GPT-2 is one (its code: resihp_jax/models/gpt2.py; copy the class here to make it
# yours). The package holds it so that `resihp demo --model gpt2` can train it too.
GPT2 = rh.models.GPT2

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
