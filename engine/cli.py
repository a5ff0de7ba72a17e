"""The ``engine`` command line: its commands (``engine._cli.commands``) run as the process's own
(``engine._cli.lifecycle``: signals and exit codes, also in ``engine --help``)."""

from __future__ import annotations

from engine._cli import lifecycle
from engine._cli.commands import cli
from engine._cli.lifecycle import (
    EXIT_BAD_INPUT,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_IO,
    EXIT_OK,
    EXIT_TERMINATED,
    EXIT_VERIFICATION,
)

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_IO",
    "EXIT_OK",
    "EXIT_TERMINATED",
    "EXIT_VERIFICATION",
    "cli",
    "main",
]


def main() -> None:
    """Entry point of the ``engine`` command: its commands, with the process's signals and exit codes.

    Raises:
        SystemExit: always, with the command's exit code.
    """
    lifecycle.main(cli)
