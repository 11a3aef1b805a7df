"""rh.models.Llama on a Grain pipeline over local text files (the Python standard library's
own .py files unless --text names others), byte-level tokens: nothing is downloaded.
python examples/grain/train.py [--steps N] [--text FILE ...]

Several hosts (every process runs this same script; rh.fit joins the job):
  resihp launch --procs 2 --devices-per-proc 4 -- python examples/grain/train.py --steps 200
  srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=4 python examples/grain/train.py
(CPUs, relaunched on failures: sbatch examples/slurm/train-cpu.sbatch examples/grain/train.py)
Install: pip install -e '.[grain]'
"""
import argparse
import pathlib

import grain
import numpy as np
import optax

import resihp_jax as rh


class ByteTokenizer(grain.transforms.Map):
    """Our tokenizer: token id = UTF-8 byte (vocab 256, the `tiny-gqa` config's)."""

    def map(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode(), np.uint8)


def pipeline(files: list[str], seed: int = 0) -> grain.MapDataset:
    # a MapDataset (random access), not an IterDataset: the library packs the documents and
    # saves its position in the checkpoint, so every host reads the same records by index
    return (grain.MapDataset.source(files)
            .map(lambda path: pathlib.Path(path).read_text(errors="replace"))
            .map(ByteTokenizer())
            .filter(lambda tokens: tokens.size >= 64)  # dropped records are skipped
            .shuffle(seed=seed))  # one fixed order, the same on every host and epoch


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--steps", type=int, default=20)
    cli.add_argument("--text", nargs="+", help="text files (default: the stdlib's .py files)")
    args = cli.parse_args()
    rh.use_cpu_devices(8)  # no accelerator: 8 fake CPU devices
    stdlib = sorted(pathlib.Path(argparse.__file__).parent.glob("*.py"))[:100]
    ds = pipeline(args.text or [str(f) for f in stdlib])
    config = rh.models.get_model_config("tiny-gqa")
    plan = rh.Plan.uniform(2, 2, 2, n_layers=config.n_layers, n_microbatches=4,
                           microbatch_size=2, seq_len=128)
    result = rh.fit(lambda rngs: rh.models.Llama(config, rngs=rngs), rh.data.from_grain(ds),
                    optimizer=optax.adamw(3e-3), plan=plan, steps=args.steps,
                    on_step=lambda r: print(f"step {r.step} loss {r.loss:.3f}"))
    print(f"trained {type(result.model).__name__} on {len(ds)} documents; "
          f"re-plans: {len(result.replans)}")
