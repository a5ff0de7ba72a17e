"""The engine's one thread mechanism: a plugin's serial chunks run one at a time on a thread kept between
them (``ThreadPool(keep=1)``), a chunk nobody waits for any more (a timeout, an abort) never holds up the
next, a worker's jobs run in order on its ``KeptThread``, and every thread is a daemon."""

from __future__ import annotations

import threading

from polling import wait_until

from engine._core.threads import KeptThread, ThreadPool, in_thread


def test_pieces_run_one_after_another_on_one_kept_thread() -> None:
    kept = ThreadPool("test-kept", keep=1, idle_seconds=None)
    try:
        first = kept.submit(threading.get_ident).result(30)
        second = kept.submit(threading.get_ident).result(30)
        assert first == second != threading.get_ident()
    finally:
        kept.close()


def test_a_piece_still_running_does_not_hold_up_the_next_and_its_thread_ends_after_it() -> None:
    kept = ThreadPool("test-kept", keep=1, idle_seconds=None)
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
    kept = ThreadPool("test-kept", keep=1, idle_seconds=None)
    thread = kept.submit(threading.current_thread).result(30)

    def fails() -> None:
        raise SystemExit("a plugin's exit")

    failed = kept.submit(fails)
    assert isinstance(failed.exception(30), SystemExit)
    kept.close()
    wait_until(lambda: not thread.is_alive())


def test_after_close_a_piece_still_runs_on_a_thread_that_ends_after_it() -> None:
    kept = ThreadPool("test-kept", keep=1, idle_seconds=None)
    kept.close()
    thread = kept.submit(threading.current_thread).result(30)
    assert thread.name == "test-kept"
    wait_until(lambda: not thread.is_alive())


def test_a_pool_reuses_an_idle_thread_and_starts_one_for_each_busy_one() -> None:
    pool = ThreadPool("test-pool")
    release = threading.Event()
    try:
        busy = [pool.submit(lambda: (release.wait(30), threading.current_thread())[1]) for _ in range(3)]
        wait_until(lambda: all(future.running() for future in busy))
        release.set()
        threads = {future.result(30) for future in busy}
        assert len(threads) == 3  # three at once: three threads
        again = {pool.submit(threading.current_thread).result(30) for _ in range(5)}
        assert len(again) == 1 and again <= threads  # one after another: an idle one, reused
        assert all(thread.daemon for thread in threads)  # the interpreter's exit never waits for one
    finally:
        release.set()
        pool.close()
    wait_until(lambda: not any(thread.is_alive() for thread in threads))  # closed: its idle threads end


def test_a_pools_thread_idle_past_its_time_ends_when_the_pool_is_next_used() -> None:
    pool = ThreadPool("test-pool", idle_seconds=0.0)
    try:
        first = pool.submit(threading.current_thread).result(30)
        assert pool.submit(threading.current_thread).result(30) is not first  # idle for 0 s: past its time
        wait_until(lambda: not first.is_alive())
    finally:
        pool.close()


def test_a_kept_thread_runs_its_jobs_in_order_behind_a_busy_one_and_waits_for_them() -> None:
    kept = KeptThread("test-worker-io")
    release = threading.Event()
    order: list[str] = []
    try:
        kept.submit(lambda: (release.wait(30), order.append("first")))
        last = kept.submit(lambda: order.append("behind it"))  # a worker's reap, queued after its call
        assert not kept.wait(0.05) and not last.done()
        release.set()
        assert kept.wait(30) and last.done()
        assert order == ["first", "behind it"]
    finally:
        release.set()
        kept.close()
    kept.join(30)


def test_in_thread_runs_on_a_daemon_thread_of_its_own_that_ends() -> None:
    thread = in_thread(threading.current_thread, "test-once").result(30)
    assert thread is not threading.current_thread() and thread.daemon and thread.name == "test-once"
    wait_until(lambda: not thread.is_alive())
