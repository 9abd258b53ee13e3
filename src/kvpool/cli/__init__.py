"""The `kvpool` command line: subcommands and their display code (stats, doctor)."""

from kvpool.cli.main import main

__all__ = ["main"]
