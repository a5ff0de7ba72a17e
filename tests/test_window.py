"""The adaptive concurrency window: its policy as pure functions, the window itself, and a real judge and endpoint
answering 429 with Retry-After above a quota."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import httpx
import pytest
from cli_support import child_env
from conftest import SleepRecorder, add_endpoint_env, add_rubric_env, item
from servers import Request, Response, Server, score, status
from test_serve import start_service, stop

from engine import Engine, EngineConfig, JudgeConfig, Limits, VerificationError
from engine._cli.render import window_lines
from engine._core.report import BatchResult, VerifierReport, VerifierTotals
from engine._core.window import DECREASE, FIRST_WINDOW, GROWTH, RAMP_STEP, Window, grown, opened, shrunk, spacing
from engine._http.retry import is_throttle
from engine._serve.metrics import Metrics
from engine._verifiers.rubric.judge import Judge
from engine._verifiers.rubric.registry import RubricRegistry

RUBRICS = Path(__file__).parent / "rubrics"
ARITH = "alice/arithmetic-correctness@1"
TASK = {"prompt": "What is 6 * 7?", "reference": "42"}


# --- the policy, pure ---------------------------------------------------------------------------------


def test_a_throttle_keeps_a_share_of_the_window_never_below_one() -> None:
    assert shrunk(64.0) == float(int(64 * DECREASE))
    assert shrunk(1.0) == 1.0 and shrunk(1.9) == 1.0
    assert shrunk(shrunk(3.0)) >= 1.0


def test_growth_is_additive_near_the_last_shrink_then_doubles_and_stops_at_the_ceiling() -> None:
    assert grown(10.0, 64, peak=12.0) == pytest.approx(10.0 + GROWTH / 10.0)  # a window's worth adds GROWTH
    assert grown(24.0, 64, peak=12.0) == 25.0  # twice the last shrink's window: the quota has lifted
    assert grown(64.0, 64, peak=12.0) == 64.0 and grown(63.5, 64, peak=12.0) == 64.0


def test_a_fresh_window_ramps_from_a_few_doubling_by_time_without_answers_up_to_the_ceiling() -> None:
    assert opened(FIRST_WINDOW, 0.0, 128) == FIRST_WINDOW
    assert opened(FIRST_WINDOW, RAMP_STEP * 1.01, 128) == 2 * FIRST_WINDOW
    assert opened(FIRST_WINDOW, RAMP_STEP * 100, 128) == 128 and opened(FIRST_WINDOW, -1.0, 128) == FIRST_WINDOW


def test_a_recovering_window_spaces_sends_at_the_rate_answered() -> None:
    assert spacing(50, 1.0) == pytest.approx(0.02)
    assert spacing(0, 0.0) == 0.0 and spacing(3, 0.0) == 0.0  # none answered yet: Retry-After was waited already


async def test_a_fresh_window_lets_in_a_few_then_one_more_per_success() -> None:
    window = Window(64, longest_pause=10.0)
    assert window.size == FIRST_WINDOW
    window.answered(window.epoch)
    assert window.size == FIRST_WINDOW + 1
    window.throttled(window.epoch, None)  # the ramp ends: it shrinks what it had let in, not the ceiling
    assert window.size == int((FIRST_WINDOW + 1) * DECREASE)


def test_429_is_a_throttle_and_503_only_with_a_retry_after() -> None:
    assert is_throttle(429, None) and is_throttle(503, 1.0)
    assert not is_throttle(503, None) and not is_throttle(500, 1.0)


# --- the window ---------------------------------------------------------------------------------------


async def test_a_burst_of_throttles_sent_before_the_shrink_shrinks_once() -> None:
    window = Window(16, longest_pause=10.0, ramp=False)
    epoch = window.epoch
    for _ in range(16):  # every request of the burst was sent before the first answer came back
        window.throttled(epoch, None)
    assert (window.size, window.epoch, window.throttles) == (int(16 * DECREASE), 1, 16)
    window.throttled(window.epoch, None)  # one sent after the shrink does shrink it again
    assert window.size == int(int(16 * DECREASE) * DECREASE)


async def test_held_slots_finish_after_a_shrink_and_new_calls_wait_until_below_it() -> None:
    window = Window(4, longest_pause=10.0, ramp=False)
    release = anyio.Event()
    entered: list[int] = []

    async def hold(n: int) -> None:
        async with window:
            entered.append(n)
            await release.wait()

    async with anyio.create_task_group() as tg:
        for n in range(4):
            tg.start_soon(hold, n)
        while len(entered) < 4:
            await anyio.lowlevel.checkpoint()
        for _ in range(3):
            window.throttled(window.epoch, None)  # 4 -> 3 -> 2 -> 1 (each sent after the last shrink)
        assert window.size == 1 and window.in_use == 4  # the held slots are still held
        tg.start_soon(hold, 4)
        await anyio.sleep(0.05)
        assert entered == [0, 1, 2, 3]  # the new call waits
        release.set()
    assert entered[-1] == 4 and window.in_use == 0


async def test_a_cancelled_waiter_and_a_parked_holder_leave_the_window_consistent() -> None:
    window = Window(1, longest_pause=10.0)
    await window.acquire()
    with anyio.move_on_after(0.05):  # an abort while queued for the one slot
        await window.acquire()
    assert window.in_use == 1
    window.throttled(window.epoch, None)  # this task's try was throttled: its slot is parked, free for others
    assert window.in_use == 0

    async def other() -> None:
        async with window:
            assert window.in_use == 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
    window.release()  # the parked holder's release (the call gave up) frees nothing more
    assert window.in_use == 0
    await window.readmit()  # not parked any more: nothing to wait for
    async with window:
        assert window.in_use == 1
    assert window.in_use == 0


# --- a real judge over a quota ------------------------------------------------------------------------


def quota(limit: int, retry_after: str) -> tuple[Server, list[tuple[int, float]]]:
    """A judge server admitting ``limit`` requests at once, 429 with ``retry_after`` above it; it records each
    answer's (status, time.monotonic())."""
    answers: list[tuple[int, float]] = []
    lock = threading.Lock()
    server = Server.judge()

    async def reply(request: Request) -> Response:
        with lock:
            over = server.in_flight > limit
            answers.append((429 if over else 200, time.monotonic()))
        if over:
            return status(429, retry_after=retry_after)
        await anyio.sleep(0.02)
        return score(1)

    server.handler.default = reply
    return server, answers


async def test_a_judge_shrinks_on_429_waits_out_retry_after_and_grows_back() -> None:
    server, answers = quota(2, "0.3")
    with server:
        async with httpx.AsyncClient() as client:
            judge = Judge(JudgeConfig(base_url=server.base_url, model="judge-test", max_concurrency=16), client)
            rubric = RubricRegistry(RUBRICS).resolve(ARITH)
            scores: list[float] = []

            async def grade() -> None:
                scores.append(await judge.grade(rubric, TASK, "42"))

            async with anyio.create_task_group() as tg:
                for _ in range(16):
                    tg.start_soon(grade)
            assert scores == [1.0] * 16
            throttled = [at for code, at in answers if code == 429]
            assert throttled and judge.window.epoch >= 1 and judge.window.size < 16
            shrunk_to = judge.window.size
            for _ in range(40):  # successes grow it back
                await grade()
            assert judge.window.size > shrunk_to


async def test_new_calls_are_not_sent_until_a_retry_after_has_passed() -> None:
    with Server.judge(status(429, retry_after="0.3")) as server:
        async with httpx.AsyncClient() as client:
            judge = Judge(JudgeConfig(base_url=server.base_url, model="judge-test"), client)
            rubric = RubricRegistry(RUBRICS).resolve(ARITH)
            async with anyio.create_task_group() as tg:
                tg.start_soon(judge.grade, rubric, TASK, "42")
                while judge.window.throttles == 0:
                    await anyio.sleep(0.005)
                told = judge.window.resume_at
                tg.start_soon(judge.grade, rubric, TASK, "42")  # a new call, during the pause
    times = sorted(server.request_times)
    assert len(times) == 3 and all(at >= told for at in times[1:])  # both the retry and the new call waited


async def test_a_judge_that_stays_over_quota_is_a_verification_error_naming_it(
    envs: Path, tmp_path: Path, sleeps: SleepRecorder
) -> None:
    rubrics = tmp_path / "rubrics"
    shutil.copytree(RUBRICS, rubrics)
    add_rubric_env(envs, "graded", ARITH)
    with Server.judge(default=status(429, retry_after="1")) as server:
        judge = JudgeConfig(base_url=server.base_url, model="judge-test", max_attempts=3, max_concurrency=4)
        config = EngineConfig(environments=envs, rubrics=rubrics, judge=judge)
        async with Engine(config, sleep=sleeps) as eng:
            with pytest.raises(VerificationError) as info:
                await eng.score([item("graded", "42", **TASK)] * 4)
    err = info.value
    assert (err.kind, err.key) == ("rubric", "alice/arithmetic-correctness")
    assert "gave up after 3 attempts" in err.reason and "HTTP 429" in err.reason, err.reason


async def test_an_endpoints_window_shrinks_on_429_and_shows_in_stats(envs: Path, sleeps: SleepRecorder) -> None:
    calls = 0

    def reply(request: Request) -> Response:
        nonlocal calls
        calls += 1
        if calls <= 8:
            return status(429, retry_after="0")
        return Response.json({"reward": 1.0})

    with Server(lambda request: _now(reply(request))) as server:
        add_endpoint_env(envs, "remote", server.url)
        config = EngineConfig(environments=envs, refs={server.url: Limits(max_concurrency=8)})
        async with Engine(config, sleep=sleeps) as eng:
            assert await eng.score([item("remote")] * 8) == [1.0] * 8
            stats = eng.stats()
    assert stats[f"engine/{server.url}/window"] < 8  # shrunk by the 429s
    assert stats[f"engine/{server.url}/retries"] == 8


async def _now(response: Response) -> Response:
    return response


def test_metrics_show_the_window_as_a_gauge() -> None:
    metrics = Metrics()
    report = VerifierReport("endpoint", "http://x/score", "http://x/score", {}, items=1, window=5)
    metrics.batch(BatchResult([1.0], [report], 0.1, verifier_of=[0]))
    text = metrics.exposition().decode()
    assert 'engine_verifier_window{kind="endpoint",verifier="http://x/score"} 5.0' in text


# --- engine score's summary, and engine serve's one window for every client --------------------------


def test_the_score_summary_names_a_window_below_its_ceiling_only(tmp_path: Path) -> None:
    judge = JudgeConfig(base_url="http://127.0.0.1:9/v1", model="m", max_concurrency=32)
    config = EngineConfig(environments=tmp_path, judge=judge, refs={"http://x/score": Limits(max_concurrency=8)})
    verifiers = {
        "alice/arithmetic-correctness": VerifierTotals("rubric", ARITH, window=9),
        "http://x/score": VerifierTotals("endpoint", "http://x/score", window=8),  # at its ceiling: not shown
        "plugin:exact": VerifierTotals("plugin", "exact"),
    }
    assert window_lines(verifiers, config) == [
        f"window: the judge of {ARITH} ended at 9 of max_concurrency 32 (429s or 503s with Retry-After shrank it)"
    ]
    assert window_lines(verifiers, None) == []


CLIENT = """
import asyncio, json, sys
import engine

async def main():
    # distinct items (identical ones would be judged once: the judge's in-batch dedup), distinct per client too
    batch = [{"environment": "graded", "task": {"prompt": f"What is 6 * 7? ({sys.argv[3]}.{n})", "reference": "42"},
              "trajectory": "42"} for n in range(int(sys.argv[2]))]
    async with engine.Engine.connect(sys.argv[1]) as eng:
        print(json.dumps(await eng.score(batch)))

asyncio.run(main())
"""


def test_two_clients_through_engine_serve_share_one_judge_window(tmp_path: Path) -> None:
    """Two client processes, 12 items each, through one engine serve against a judge admitting 2 at once: both
    batches succeed, the judge never saw more than the one window's ceiling, and that window shrank."""
    server, answers = quota(2, "0.05")
    envs = tmp_path / "envs"
    envs.mkdir()
    add_rubric_env(envs, "graded", ARITH)
    shutil.copytree(RUBRICS, tmp_path / "rubrics")
    with server:
        service = start_service(tmp_path, f'rubrics = "rubrics"\n[judge]\nbase_url = "{server.base_url}"\n'
                                          'model = "judge-test"\nmax_concurrency = 6\nmax_attempts = 40\n')
        try:
            clients = [subprocess.Popen([sys.executable, "-c", CLIENT, service.url, "12", str(number)],
                                        env=child_env(None), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                       for number in range(2)]
            outs = [client.communicate(timeout=120) for client in clients]
            gauges = {labels: value for (name, labels), value in service.metrics().items()
                      if name == "engine_verifier_window"}
        finally:
            stop(service)
    assert [client.returncode for client in clients] == [0, 0], outs
    assert [json.loads(out) for out, _ in outs] == [[1.0] * 12] * 2
    assert sum(code == 200 for code, _ in answers) == 24 and any(code == 429 for code, _ in answers)
    assert server.max_in_flight <= 6  # one window of 6 for both clients, not one each
    (window,) = [value for labels, value in gauges.items() if ("kind", "rubric") in labels]
    assert window < 6
