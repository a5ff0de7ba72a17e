"""``python -m engine`` and the ``engine`` command: the command line of ``engine.cli``.

Importing the CLI takes a noticeable moment (pyarrow, httpx, rich): a Ctrl-C meanwhile ends the
command with one line and exit 130, like a Ctrl-C later on, not with an import traceback.
"""

import os
import sys


def main() -> None:
    """Import the command line, then run it."""
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted (Ctrl-C) while starting; nothing was written\n")
        sys.stderr.flush()
        os._exit(130)  # not sys.exit: see engine.cli.main
    cli_main()


if __name__ == "__main__":
    main()
