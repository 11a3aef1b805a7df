"""The `resihp` command line: every subcommand's parser and entry, and nothing else.

Each subcommand module turns its flags into the library's typed configs at the door and
calls the same objects a training script would; no module outside this package parses
arguments or takes an `argparse.Namespace`.
"""

from resihp_jax.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
