"""``python -m engine`` and the ``engine`` command: the command line of ``engine.cli``."""

import os
import signal
import sys
from types import FrameType


def main() -> None:
    """Import the command line, then run it.

    Importing the CLI takes a noticeable moment (pyarrow, httpx, rich): a Ctrl-C or a SIGTERM
    meanwhile ends the command with one line and exit 130 or 143, as later on, not with an import
    traceback or a silent death. The CLI installs its own handlers once imported.
    """
    terminated: list[int] = []

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if terminated:
            return  # already stopping
        terminated.append(signum)
        raise KeyboardInterrupt  # unwinds the import, to the report below

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        from engine import cli
        from engine._cli.lifecycle import on_signal

        signal.signal(signal.SIGTERM, on_signal)  # the CLI's own from here on (its main installs it too)
    except KeyboardInterrupt:
        stopped = "terminated (SIGTERM)" if terminated else "interrupted (Ctrl-C)"
        sys.stderr.write(f"error: {stopped} while starting; nothing was written\n")
        sys.stderr.flush()
        os._exit(143 if terminated else 130)  # not sys.exit: see engine._cli.lifecycle.main
    cli.main()


if __name__ == "__main__":
    main()
