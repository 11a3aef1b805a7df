"""The `resihp` command line: every subcommand's parser and entry, turning flags into the
typed configs a script would build (no module outside it parses arguments)."""

from resihp_jax.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
