"""``KeptThread``: a plugin's serial chunks run one at a time on a thread kept between them, and a
chunk nobody waits for any more (a timeout, an abort) never holds up the next."""

from __future__ import annotations

import threading

from polling import wait_until

from engine._core.threads import KeptThread


def test_pieces_run_one_after_another_on_one_kept_thread() -> None:
    kept = KeptThread("test-kept")
    try:
        first = kept.submit(threading.get_ident).result(30)
        second = kept.submit(threading.get_ident).result(30)
        assert first == second != threading.get_ident()
    finally:
        kept.close()


def test_a_piece_still_running_does_not_hold_up_the_next_and_its_thread_ends_after_it() -> None:
    kept = KeptThread("test-kept")
    release = threading.Event()
    try:
        stuck = kept.submit(lambda: (release.wait(30), threading.current_thread())[1])  # its caller gave up on it
        wait_until(lambda: stuck.running())
        after = kept.submit(threading.current_thread).result(30)  # runs at once, elsewhere
        assert not stuck.done()
        release.set()
        old = stuck.result(30)
        assert old is not after
        wait_until(lambda: not old.is_alive())  # the old thread ended once its piece did
        assert after.is_alive()  # the new one is kept
        assert kept.submit(threading.current_thread).result(30) is after
    finally:
        release.set()
        kept.close()


def test_close_ends_the_thread_and_a_failure_reaches_its_waiter() -> None:
    kept = KeptThread("test-kept")
    thread = kept.submit(threading.current_thread).result(30)

    def fails() -> None:
        raise SystemExit("a plugin's exit")

    failed = kept.submit(fails)
    assert isinstance(failed.exception(30), SystemExit)
    kept.close()
    wait_until(lambda: not thread.is_alive())
