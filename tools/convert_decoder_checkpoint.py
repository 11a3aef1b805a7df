"""Convert a checkpoint of resihp_jax's retired built-in decoder ({embed, layers, head}) into
one that `resihp train --resume` (and every run of the one step builder) restores.

    python tools/convert_decoder_checkpoint.py OLD_CHECKPOINT_DIR NEW_CHECKPOINT_DIR [--step N]

Reads the newest checkpoint of OLD_CHECKPOINT_DIR (or step N) onto the host, renames its
leaves into rh.models.Llama's {shell, blocks} (the parameters and Adam's statistics alike) and
writes it, with its step, data position and plan, into NEW_CHECKPOINT_DIR (new or empty). The
old directory is left as it was. Exit status: 0 when converted, 2 for a bad argument or a
checkpoint it cannot convert (one line says why).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="convert_decoder_checkpoint.py",
        description="Convert a checkpoint of the retired built-in decoder ({embed, layers, "
                    "head}) into rh.models.Llama's {shell, blocks}, which resumes as is.")
    parser.add_argument("source", type=Path, help="the old checkpoint directory (read only)")
    parser.add_argument("destination", type=Path,
                        help="where the converted checkpoint goes (new or empty)")
    parser.add_argument("--step", type=int, default=None,
                        help="the checkpoint step to convert (default: the newest)")
    args = parser.parse_args(argv)
    from resihp_jax.errors import ResihpError  # after parsing: --help needs no JAX
    from resihp_jax.runtime.run.convert import convert_checkpoint

    try:
        convert_checkpoint(args.source, args.destination, args.step)
    except ResihpError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
