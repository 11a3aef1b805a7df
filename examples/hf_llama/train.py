"""rh.models.Llama on a Hugging Face `datasets` dataset of local text files (the Python
standard library's own .py files unless --text names others), byte-level tokens: nothing is
downloaded. python examples/hf_llama/train.py [--steps N] [--text FILE ...]

Several hosts (every process runs this same script; rh.fit joins the job):
  resihp launch --procs 2 --devices-per-proc 4 -- python examples/hf_llama/train.py --steps 200
  srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=4 python examples/hf_llama/train.py
(CPUs, relaunched on failures: sbatch examples/slurm/train-cpu.sbatch examples/hf_llama/train.py)
Install: pip install -e '.[hf]'
"""
import argparse
import pathlib

import datasets
import numpy as np
import optax

import resihp_jax as rh


def byte_tokens(row: dict) -> dict:
    """Our tokenizer: token id = UTF-8 byte (vocab 256, the `tiny` config's)."""
    return {"input_ids": np.frombuffer(row["text"].encode(), np.uint8)}


def load(files: list[str]) -> datasets.Dataset:
    # one row per file (sample_by="document"): each file is one document to pack
    ds = datasets.load_dataset("text", data_files=files, split="train", sample_by="document")
    return ds.map(byte_tokens, remove_columns=["text"]).with_format("numpy")


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--steps", type=int, default=20)
    cli.add_argument("--text", nargs="+", help="text files (default: the stdlib's .py files)")
    args = cli.parse_args()
    rh.use_cpu_devices(8)  # no accelerator: 8 fake CPU devices
    stdlib = sorted(pathlib.Path(argparse.__file__).parent.glob("*.py"))[:100]
    ds = load(args.text or [str(f) for f in stdlib])
    config = rh.models.get_model_config("tiny")
    plan = rh.Plan.uniform(2, 2, 2, n_layers=config.n_layers, n_microbatches=4,
                           microbatch_size=2, seq_len=128)
    result = rh.fit(lambda rngs: rh.models.Llama(config, rngs=rngs),
                    rh.data.from_hf_dataset(ds, column="input_ids"),
                    optimizer=optax.adamw(3e-3), plan=plan, steps=args.steps,
                    on_step=lambda r: print(f"step {r.step} loss {r.loss:.3f}"))
    print(f"trained {type(result.model).__name__} on {len(ds)} documents; "
          f"re-plans: {len(result.replans)}")
