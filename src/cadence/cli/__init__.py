"""The ``cadence`` command: argument parsing, the subcommands, and the reference pages generated from them."""

from cadence.cli.main import main

__all__ = ["main"]
