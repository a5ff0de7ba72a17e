"""The ``engine`` command as a process: its exit codes, the signals that stop a run, and how it exits.

The library itself installs no signal handler: only :func:`main`, the CLI's own process's entry point, does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import traceback
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any, NoReturn, TypeVar

import anyio
import click
from rich.text import Text

from engine._cli.render import cause_line, close_progress, failure_details, stderr
from engine._errors import EngineError, UnreadyError, VerificationError, WriteError

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_DISAGREE",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_IO",
    "EXIT_OK",
    "EXIT_TERMINATED",
    "EXIT_VERIFICATION",
    "Commands",
    "fail",
    "interrupted",
    "main",
    "on_signal",
    "outcome",
    "run",
]

# Exit codes (also in ``engine --help``). A backfill stopped by any of them keeps its checkpoint, releases
# its lock, and says in one ``error:`` line what happened and how to continue (``--resume``).
EXIT_OK = 0  # done
EXIT_VERIFICATION = 1  # a verification error aborted the run (engine check: a check failed)
EXIT_BAD_INPUT = 2  # bad usage, config, manifest, input, or an output that cannot be resumed
EXIT_IO = 3  # the output or its state could not be written (disk full, I/O error)
EXIT_DISAGREE = 4  # engine audit / engine diff: a verifier's rewards differ beyond --tolerance (not an error)
# EX_SOFTWARE of sysexits.h: a bug in the engine, an exception none of its own errors (engine._errors), reported
# with its traceback, never as bad input (outcome() draws that line)
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130  # interrupted (Ctrl-C)
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports a process the signal ended

T = TypeVar("T")


def fail(code: int, message: str) -> NoReturn:
    """Say ``message`` in one ``error:`` line on stderr (below the progress bar's last redraw); exit with ``code``."""
    close_progress()
    stderr.print(Text("error: ", style="bold red") + Text(message), soft_wrap=True)
    sys.exit(code)


class _Signals:
    """How this process is stopping: whether SIGINT (Ctrl-C) or SIGTERM was received (:func:`on_signal`,
    installed by :func:`main` only), which came first, and whether the interrupt was reported
    (:func:`interrupted`). ``stop`` is set while :func:`run` runs: it stops the run from its event loop."""

    received = False
    terminated = False
    reported = False
    stop: Callable[[], None] | None = None


def on_signal(signum: int, frame: FrameType | None) -> None:
    """Stop on SIGINT or SIGTERM: the run unwinds, keeps its checkpoint and releases its lock; then say which.

    During a run the run's own cancel scope is cancelled, from its event loop: the cancellation
    then goes through anyio's task groups and worker threads as any cancellation does. An
    exception raised here instead would land wherever the main thread happens to be (inside a task
    group, between a thread's result and its caller) and come out as a traceback. Outside a run
    (reading the config, counting rows) plain code runs: KeyboardInterrupt unwinds it. Signals
    after the first change nothing: the process is already stopping.
    """
    if _Signals.received:
        return
    _Signals.received = True
    _Signals.terminated = signum == signal.SIGTERM
    if _Signals.stop is not None:
        _Signals.stop()
        return
    raise KeyboardInterrupt


def _no_loop_to_stop() -> None:
    """A run's ``stop`` while its loop is not running yet or no more: the run checks ``received`` itself."""


def interrupted(after: str = "") -> NoReturn:
    """Say which signal stopped the command, then ``after`` (what a run kept), and exit 130 or 143."""
    _Signals.reported = True
    if _Signals.terminated:
        fail(EXIT_TERMINATED, "terminated (SIGTERM)" + after)
    fail(EXIT_INTERRUPTED, "interrupted (Ctrl-C)" + after)


async def _stoppable(fn: Callable[[], Awaitable[T]], result: list[T]) -> None:
    """Run ``fn`` in a cancel scope that a signal cancels (through ``_Signals.stop``); append what it returns."""
    loop = asyncio.get_running_loop()
    with anyio.CancelScope() as scope:

        def stop() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the run is over anyway
                loop.call_soon_threadsafe(scope.cancel)  # safe from a signal handler, and wakes the loop up

        _Signals.stop = stop
        try:
            if _Signals.received:  # a signal came while the loop was starting
                scope.cancel()
            result.append(await fn())
        finally:
            _Signals.stop = _no_loop_to_stop


def run(fn: Callable[[], Awaitable[T]], kept: Callable[[], str] | None = None, *, whole: bool = False) -> T:
    """Run ``fn`` on an asyncio loop, turning the engine's errors into messages and exit codes.

    Once a signal was received, whatever ends the run (cancellation, or an error or exception group
    the cancellation caused) is reported as that signal, in one line.

    Args:
        fn: the run.
        kept: what a run stopped by an interrupt or a write error kept, and how to go on.
        whole: a verification error shows the whole traceback of what the verifier raised (``--traceback``).

    Returns:
        What ``fn`` returned.

    Raises:
        SystemExit: the run failed with one of the engine's own errors, or was stopped by a signal.
        Exception: any other the run raised (a bug: the command group reports it).
    """
    result: list[T] = []

    def after() -> str:
        return f"; {kept()}" if kept is not None else ""

    _Signals.stop = _no_loop_to_stop
    try:
        try:
            anyio.run(_stoppable, fn, result, backend="asyncio")
        finally:
            _Signals.stop = None
    except BaseException as exc:
        if _Signals.received or isinstance(exc, KeyboardInterrupt):
            interrupted(after())
        known = outcome(exc, after, whole=whole)
        if known is None:
            raise  # a bug: the command group reports it (Commands)
        fail(*known)
    if _Signals.received or not result:
        interrupted(after())
    return result[0]


def outcome(
    exc: BaseException, after: Callable[[], str] | None = None, *, whole: bool = False
) -> tuple[int, str] | None:
    """The exit code and ``error:`` message of one of the engine's own errors; None for any other exception.

    Only an error the engine raises on purpose (``engine._errors``) says something about the
    user's input, config, verifiers or disk. The misuse a user's input can cause is turned into
    one of them where the input is read (a bad row: ``InputError``, by its line); a ``ValueError``
    or ``TypeError`` from anywhere else is a bug in the engine and must not read as bad input.

    A verification error's message goes on with its cause, its notes, and where it failed: a plugin's own
    frames, or with ``whole`` the whole traceback of what the verifier raised (``failure_details``).

    Args:
        exc: what ended the command.
        after: for a verification or write error, what the run kept and how to go on.
        whole: show the whole traceback of a verification error's cause, not only the plugin's frames.

    Returns:
        The exit code and message, or None if ``exc`` is not one of the engine's own errors.
    """
    if isinstance(exc, VerificationError | UnreadyError):
        lines = [str(exc)]
        if exc.__cause__ is not None:
            lines.append(f"cause: {cause_line(exc.__cause__)}")
        lines += getattr(exc, "__notes__", [])
        if isinstance(exc, VerificationError):
            lines += failure_details(exc, whole)
        if kept := (after() if after is not None else "").removeprefix("; "):
            lines.append(kept)  # what a run stopped by it kept, and how to go on, as an interrupt says
        return EXIT_VERIFICATION, "\n  ".join(lines)
    if isinstance(exc, WriteError):
        return EXIT_IO, f"{exc}{after() if after is not None else ''}"
    if isinstance(exc, EngineError):
        return EXIT_BAD_INPUT, str(exc)
    return None


def _internal(exc: Exception) -> NoReturn:
    """Report a bug: the traceback, then one ``error:`` line that says it is one; exit 70."""
    close_progress()
    sys.stderr.write("".join(traceback.format_exception(exc)))
    sys.stderr.flush()
    fail(EXIT_INTERNAL, f"internal error (a bug in engine, not in your input): {type(exc).__name__}: {exc}")


class Commands(click.Group):
    """The ``engine`` command group: an exception none of its commands handled gets its exit code (:func:`outcome`),
    or, if it is not one of the engine's own errors, is reported as a bug (:func:`_internal`).

    Here rather than in :func:`main`, so that it holds however the group is invoked (``engine``,
    ``python -m engine``, click's test runner).
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # click's own: usage errors and the like, reported by click
        except Exception as exc:
            known = outcome(exc)  # one of the engine's own errors, raised outside a run
            if known is None:
                _internal(exc)
            fail(*known)


def main(group: click.Group) -> None:
    """Run ``group`` as the process's command line: the process is the CLI's, so it handles SIGTERM (as Ctrl-C).

    Args:
        group: the ``engine`` command group.

    Raises:
        SystemExit: always, with the command's exit code (or the process ends at once, with it, once a signal
            stopped it).
    """
    try:
        _main(group)
    except SystemExit as exc:
        if _Signals.reported:
            # Interrupted, and said so: exit with our code now. A KeyboardInterrupt that went through
            # code compiled from a string (a dataclass or namedtuple being created, as imports do)
            # makes CPython end ``python -m engine`` by SIGINT whatever SystemExit says, so SIGTERM
            # would look like Ctrl-C. The run has already unwound (files closed, lock released).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exc.code if isinstance(exc.code, int) else EXIT_INTERRUPTED)
        raise


def _main(group: click.Group) -> None:
    try:
        signal.signal(signal.SIGTERM, on_signal)
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # ignored: a background job, left so
            signal.signal(signal.SIGINT, on_signal)
        # The CLI reports an abort itself, on stderr with its exit code; without a handler of its own
        # the engine logger's ERROR record would reach Python's last-resort handler and say it twice.
        logging.getLogger("engine").addHandler(logging.NullHandler())
        try:
            # Not standalone: click would report Ctrl-C as "Aborted!" with exit 1; it is ours to report.
            code = group.main(prog_name="engine", standalone_mode=False)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            interrupted()
        sys.exit(code if isinstance(code, int) else EXIT_OK)
    except KeyboardInterrupt:
        interrupted()
