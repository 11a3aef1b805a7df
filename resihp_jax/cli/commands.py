"""The `resihp` command: one subcommand per job, each defined beside the code it drives."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from resihp_jax.errors import Preempted, ResihpError

# subcommand -> module defining `add_arguments(parser)` and `run(args) -> int`.
# Modules are imported lazily so `resihp plan` never pays for importing JAX.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("resihp_jax.cli.train", "train a model on fake or real devices"),
    "plan": ("resihp_jax.cli.next_plan", "choose the next Plan for a health map"),
    "demo": ("resihp_jax.cli.demo", "a resilient run with an injected fault, end to end"),
    "launch": ("resihp_jax.cli.launch", "run a training job as N local processes, "
               "relaunched on the survivors when one dies or hangs"),
    "simulate": ("resihp_jax.cli.simulate", "week-long cluster failure simulation against peer policies"),  # noqa: E501
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="resihp", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(sub)
        sub.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except ResihpError as err:
        print(f"resihp {args.command}: error: {err}", file=sys.stderr)
        return 2
    except Preempted as err:  # a one-process run saved its step on SIGTERM
        print(f"resihp {args.command}: {err}", file=sys.stderr)
        return err.EXIT
