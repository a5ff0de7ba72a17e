"""The command line: a thin layer that parses options and calls keyword-only functions.

Exit codes: 0 done; 1 a verification error aborted the run; 2 bad usage, config or input.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .digest import digest_directory

__all__ = ["EXIT_BAD_INPUT", "EXIT_OK", "EXIT_VERIFICATION", "main"]

EXIT_OK = 0
EXIT_VERIFICATION = 1
EXIT_BAD_INPUT = 2


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Score rollouts with rubric, plugin and endpoint verifiers."""


@cli.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
def digest(directory: Path) -> None:
    """Print an environment directory's digest (the value to pin under [pins])."""
    click.echo(digest_directory(directory))


def main() -> None:
    """Entry point of the ``engine`` command."""
    sys.exit(cli.main(standalone_mode=True))
