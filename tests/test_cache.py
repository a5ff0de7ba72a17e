"""The verdict cache and in-batch dedup of rubric verifiers, against real judge servers counting calls on 127.0.0.1,
real SQLite files and real processes sharing one.

The judge scores an item with the number its response is (``test_engine_rubric.by_response``), so rewards can be
checked item by item, and every request it receives is one judge call.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from click.testing import CliRunner
from conftest import add_rubric_env, item
from polling import eventually
from servers import Request, Response, Server, judges, status
from test_engine_rubric import ARITH, HELP, RUBRICS, by_response, judged, response_of

import engine._verifiers.rubric.verdicts as verdicts_module
from engine import BatchResult, CacheConfig, CacheError, Engine, EngineConfig, JudgeConfig, VerificationError
from engine._cli.lifecycle import EXIT_BAD_INPUT
from engine._verifiers.rubric.prompt import PROMPT_VERSION
from engine.cli import cli

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def serve() -> Iterator[Any]:
    with judges(default=by_response) as start:
        yield start


@pytest.fixture
def rubrics(tmp_path: Path) -> Path:
    target = tmp_path / "rubrics"
    shutil.copytree(RUBRICS, target)
    return target


def config(envs: Path, rubrics: Path, server: Server, cache: Path | None = None, *, max_entries: int = 1000,
           busy_timeout: float = 5.0, **judge: Any) -> EngineConfig:
    return EngineConfig(
        environments=envs, rubrics=rubrics, allow_unpinned=True,
        judge=JudgeConfig(base_url=server.base_url, model=judge.pop("model", "judge-test"), **judge),
        cache=CacheConfig(cache, max_entries=max_entries, busy_timeout=busy_timeout) if cache is not None else None,
    )


def grpo(environment: str, groups: int, size: int) -> list[dict[str, Any]]:
    """Groups of completions, each group's prompt its own, half of each group's answers one repeated answer."""
    return [
        item(environment, str(answer if k % 2 else 0), prompt=f"question {g}", reference="42")
        for g in range(groups) for k, answer in enumerate(range(size))
    ]


async def test_identical_items_are_judged_once_with_the_rewards_of_judging_each(
    serve: Any, envs: Path, rubrics: Path
) -> None:
    add_rubric_env(envs, "graded", ARITH)
    batch = grpo("graded", 4, 8)  # per group: 4 distinct odd answers, and 0 four times
    plain, deduping = serve(), serve()
    async with Engine(config(envs, rubrics, plain, dedupe=False)) as eng:
        every = await eng.run(batch)
    async with Engine(config(envs, rubrics, deduping)) as eng:
        once = await eng.run(batch)
    assert len(plain.requests) == 32
    assert len(deduping.requests) == 4 * 5  # 4 groups x (4 odd answers + one 0)
    assert once.rewards == every.rewards
    (report,) = once.verifiers
    assert (report.items, report.deduped, report.cache_hits) == (32, 12, 0)
    assert report.reward_sum == pytest.approx(sum(every.rewards))
    assert every.verifiers[0].deduped == 0
    assert dict(once.usage)["requests"] == 20


def holding(*held: str) -> tuple[Any, dict[str, threading.Event]]:
    """A judge reply that holds each request whose answer is one of ``held`` until its event is set, then scores it
    as ``by_response`` does (the answer ``fail`` is a 400); and those events."""
    events = {answer: threading.Event() for answer in held}

    async def reply(request: Request) -> Response:
        answer = response_of(request)
        if answer in events:  # on the judge server's loop, which goes on serving the other requests
            await eventually(events[answer].is_set, message=f"the request for {answer} was never released")
        return status(400) if answer == "fail" else by_response(request)

    return reply, events


def calls_in_flight(eng: Engine) -> verdicts_module.InFlight:
    """The open engine's judge calls in flight: their waiters are what the test waits on."""
    shared = eng._registry._shared
    assert shared is not None
    return shared.in_flight


async def test_an_item_identical_to_one_in_flight_in_another_batch_waits_for_that_call(
    serve: Any, envs: Path, rubrics: Path
) -> None:
    # as two requests to engine serve (two ranks) with one completion do: one call for both
    add_rubric_env(envs, "graded", ARITH)
    reply, events = holding("3")
    server = serve(default=reply)
    results: dict[str, BatchResult] = {}
    async with Engine(config(envs, rubrics, server)) as eng:
        in_flight = calls_in_flight(eng)

        async def run(name: str, batch: list[dict[str, Any]]) -> None:
            results[name] = await eng.run(batch)

        async with anyio.create_task_group() as group:
            group.start_soon(run, "a", [judged("graded", "3"), judged("graded", "5")])
            await eventually(lambda: len(server.requests) == 2)
            group.start_soon(run, "b", [judged("graded", "3"), judged("graded", "7")])
            await eventually(lambda: in_flight.waiting == 1 and len(server.requests) == 3)
            events["3"].set()
    assert results["a"].rewards == [0.3, 0.5] and results["b"].rewards == [0.3, 0.7]
    assert sorted(response_of(request) for request in server.requests) == ["3", "5", "7"]
    assert (results["a"].verifiers[0].deduped, results["b"].verifiers[0].deduped) == (0, 1)
    assert dict(results["b"].usage)["requests"] == 1


async def test_a_call_in_flight_that_is_cancelled_shares_nothing_and_its_waiters_call_at_once(
    serve: Any, envs: Path, rubrics: Path
) -> None:
    add_rubric_env(envs, "graded", ARITH)
    reply, events = holding("3", "fail")
    server = serve(default=reply)
    async with Engine(config(envs, rubrics, server)) as eng:
        in_flight = calls_in_flight(eng)
        failed: list[VerificationError] = []
        results: list[BatchResult] = []

        async def first() -> None:
            with pytest.raises(VerificationError) as info:
                await eng.run([judged("graded", "3"), judged("graded", "fail")])
            failed.append(info.value)

        async def waiter() -> None:
            results.append(await eng.run([judged("graded", "3")]))

        async with anyio.create_task_group() as group:
            group.start_soon(first)
            await eventually(lambda: len(server.requests) == 2)
            group.start_soon(waiter)
            group.start_soon(waiter)
            await eventually(lambda: in_flight.waiting == 2)
            events["fail"].set()  # the first batch aborts, cancelling its call for 3 that the others wait for
            # each waiter's own call, both in flight at once (not one queued behind the other's)
            await eventually(lambda: failed and len(server.requests) == 4)
            events["3"].set()
    assert failed[0].index == 1
    assert [result.rewards for result in results] == [[0.3], [0.3]]
    assert [result.verifiers[0].deduped for result in results] == [0, 0]
    assert [response_of(request) for request in server.requests].count("3") == 3
    assert in_flight.waiting == 0


async def test_a_second_scoring_is_served_from_the_cache_saying_so(serve: Any, envs: Path, rubrics: Path,
                                                                     tmp_path: Path) -> None:
    server = serve()
    add_rubric_env(envs, "graded", ARITH)
    add_rubric_env(envs, "helpful", HELP)
    batch = [judged("graded", "3"), item("arith", "42", reference="42"), judged("graded", "3"), judged("helpful", "4")]
    path = tmp_path / "cache" / "verdicts.sqlite"
    before = time.time()
    async with Engine(config(envs, rubrics, server, path)) as eng:
        first = await eng.run(batch)
    after = time.time()
    assert len(server.requests) == 2 and not first.cached
    async with Engine(config(envs, rubrics, server, path)) as eng:
        second = await eng.run(batch)
        stats = eng.stats()
    assert len(server.requests) == 2  # no judge call
    assert second.rewards == first.rewards == [0.3, 1.0, 0.3, 0.75]
    assert sorted(second.cached) == [0, 2, 3]
    for index in (0, 2, 3):
        when = second.provenance(index)["cached"]
        assert before <= when <= after
        assert {k: v for k, v in second.provenance(index).items() if k != "cached"} == first.provenance(index)
    assert "cached" not in second.provenance(1)
    reports = {report.key: report for report in second.verifiers}
    assert (reports[ARITH].cache_hits, reports[ARITH].deduped, reports[ARITH].items) == (2, 0, 2)
    assert stats[f"engine/{ARITH}/cache_hits"] == 2 and stats[f"engine/{ARITH}/cache_hit_rate"] == 1.0
    assert stats["engine/arith/verify:score/cache_hits"] == 0


def _changed(rubrics: Path, what: str) -> dict[str, Any]:
    """The judge settings (and rubric files) of a run that differs from the first in ``what``."""
    if what == "rubric text":  # an edited file: its digest and its text change
        path = rubrics / ARITH / "2.md"
        path.write_text(path.read_text() + "\nBe harsh.\n")
    return {"model": {"model": "judge-other"}, "temperature": {"temperature": 0.5}, "max_tokens": {"max_tokens": 64},
            "response_format": {"response_format": False}}.get(what, {})


@pytest.mark.parametrize("what", ["nothing", "rubric version", "rubric text", "model", "temperature", "max_tokens",
                                  "response_format", "prompt version", "task", "trajectory"])
async def test_every_part_of_the_key_decides_a_hit(serve: Any, envs: Path, rubrics: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    server = serve()
    add_rubric_env(envs, "graded", ARITH)
    add_rubric_env(envs, "pinned", f"{ARITH}@1")
    path = tmp_path / "verdicts.sqlite"
    async with Engine(config(envs, rubrics, server, path)) as eng:
        await eng.run([judged("graded", "1")])
    assert len(server.requests) == 1
    settings = _changed(rubrics, what)
    if what == "prompt version":
        monkeypatch.setattr(verdicts_module, "PROMPT_VERSION", PROMPT_VERSION + 1)
    again = {"rubric version": judged("pinned", "1"), "task": item("graded", "1", prompt="What is 7 * 6?",
                                                                   reference="42"),
             "trajectory": judged("graded", "01")}.get(what, judged("graded", "1"))
    async with Engine(config(envs, rubrics, server, path, **settings)) as eng:
        result = await eng.run([again])
    assert len(server.requests) == (1 if what == "nothing" else 2)
    assert result.verifiers[0].cache_hits == (1 if what == "nothing" else 0)


async def test_a_failure_is_never_cached(serve: Any, envs: Path, rubrics: Path, tmp_path: Path) -> None:
    server = serve(status(500), status(500), status(500), status(500), status(500))  # every try of the first call
    add_rubric_env(envs, "graded", ARITH)
    path = tmp_path / "verdicts.sqlite"
    async with Engine(config(envs, rubrics, server, path, max_attempts=5, retry_deadline=60.0),
                      sleep=_no_sleep) as eng:
        with pytest.raises(VerificationError):
            await eng.run([judged("graded", "5"), judged("graded", "5")])
        assert len(server.requests) == 5
        assert (await eng.run([judged("graded", "5")])).rewards == [0.5]  # judged: nothing was kept of the failure
    assert len(server.requests) == 6
    async with Engine(config(envs, rubrics, server, path)) as eng:
        assert (await eng.run([judged("graded", "5")])).rewards == [0.5]
    assert len(server.requests) == 6  # the success was kept


async def _no_sleep(seconds: float) -> None:
    pass


async def test_items_scored_before_an_abort_are_kept(serve: Any, envs: Path, rubrics: Path, tmp_path: Path) -> None:
    server = serve()
    add_rubric_env(envs, "graded", ARITH)
    path = tmp_path / "verdicts.sqlite"
    async with Engine(config(envs, rubrics, server, path, max_concurrency=1)) as eng:
        with pytest.raises(VerificationError):
            await eng.run([judged("graded", "2"), judged("graded", "no-score")])
        await eng.run([judged("graded", "2")])
    assert len(server.requests) == 2  # the first item's verdict, scored before the abort, was served


def test_concurrent_writers_in_real_processes_share_one_cache(serve: Any, envs: Path, rubrics: Path,
                                                              tmp_path: Path) -> None:
    server = serve()
    add_rubric_env(envs, "graded", ARITH)
    path = tmp_path / "verdicts.sqlite"
    script = textwrap.dedent(f"""
        import asyncio, sys
        from engine import CacheConfig, Engine, EngineConfig, JudgeConfig
        config = EngineConfig(environments={str(envs)!r}, rubrics={str(rubrics)!r}, allow_unpinned=True,
                              judge=JudgeConfig(base_url={server.base_url!r}, model="judge-test"),
                              cache=CacheConfig({str(path)!r}))
        async def main():
            async with Engine(config) as eng:
                for round in range(5):
                    items = [{{"environment": "graded", "task": {{"prompt": f"q{{round}}-{{k}}", "reference": "42"}},
                              "trajectory": str((k + int(sys.argv[1])) % 10)}} for k in range(20)]
                    rewards = await eng.score(items)
                    assert rewards == [((k + int(sys.argv[1])) % 10) / 10 for k in range(20)], rewards
        asyncio.run(main())
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    workers = [subprocess.Popen([sys.executable, "-c", script, str(n)], env=env, stderr=subprocess.PIPE)
               for n in range(3)]
    for worker in workers:
        _, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err.decode()
        assert b"not stored" not in err
    with sqlite3.connect(path) as db:
        (count,) = db.execute("SELECT count(*) FROM verdicts").fetchone()
    distinct = {(r, k, (k + n) % 10) for n in range(3) for r in range(5) for k in range(20)}
    assert count == len(distinct)
    assert len(server.requests) >= count  # two processes may judge one item before either has stored it


@pytest.mark.parametrize("content", [b"this is not a database, not at all" * 100, "another program"])
async def test_a_file_that_is_not_a_cache_fails_the_open_before_any_judge_call(
    serve: Any, envs: Path, rubrics: Path, tmp_path: Path, content: bytes | str
) -> None:
    server = serve()
    add_rubric_env(envs, "graded", ARITH)
    path = tmp_path / "verdicts.sqlite"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE users (name TEXT)")
        db.close()
    before = path.read_bytes()
    with pytest.raises(CacheError) as info:
        async with Engine(config(envs, rubrics, server, path)) as eng:
            await eng.run([judged("graded", "1")])
    assert info.value.path == path and str(path) in str(info.value) and not info.value.ours
    assert "if it is the cache, delete it" in str(info.value)
    assert not server.requests
    assert path.read_bytes() == before  # not even switched to WAL mode: the file is someone else's
    config_file = str(_config_file(tmp_path, envs, rubrics, server, path))
    result = CliRunner().invoke(cli, ["cache", "clear", "--config", config_file])
    # a file the engine did not make may be someone's data (a [cache] path pointed at the wrong file): kept
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert "not a verdict cache" in result.stderr
    assert path.read_bytes() == before
    path.unlink()  # what the message says to do, if it is the cache
    async with Engine(config(envs, rubrics, server, path)) as eng:  # mended
        assert await eng.score([judged("graded", "1")]) == [0.1]


async def test_a_cache_of_another_schema_version_is_made_anew_by_clear(
    serve: Any, envs: Path, rubrics: Path, tmp_path: Path
) -> None:
    server = serve()
    add_rubric_env(envs, "graded", ARITH)
    path = tmp_path / "verdicts.sqlite"
    async with Engine(config(envs, rubrics, server, path)) as eng:
        assert await eng.score([judged("graded", "1")]) == [0.1]
    with sqlite3.connect(path) as db:  # as a later engine's cache would read to this one
        db.execute("UPDATE engine_cache SET value = '999' WHERE name = 'schema'")
    with pytest.raises(CacheError) as info:
        async with Engine(config(envs, rubrics, server, path)):
            pass
    assert info.value.ours and "schema version 999" in info.value.reason
    assert "'engine cache clear' makes it anew" in str(info.value)
    config_file = str(_config_file(tmp_path, envs, rubrics, server, path))
    assert CliRunner().invoke(cli, ["cache", "clear", "--verifier", "x/y", "--config", config_file]).exit_code == 2
    result = CliRunner().invoke(cli, ["cache", "clear", "--config", config_file])
    assert result.exit_code == 0, result.output
    assert "made anew" in result.stdout
    calls = len(server.requests)
    async with Engine(config(envs, rubrics, server, path)) as eng:
        assert await eng.score([judged("graded", "1")]) == [0.1]
    assert len(server.requests) == calls + 1  # the old verdict went with it


async def test_a_locked_file_skips_the_write_with_one_warning_and_the_reward_is_right(
    serve: Any, envs: Path, rubrics: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = serve()
    add_rubric_env(envs, "graded", ARITH)
    path = tmp_path / "verdicts.sqlite"
    async with Engine(config(envs, rubrics, server, path)):
        pass  # made
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process's long write, as SQLite sees it
    try:
        with caplog.at_level(logging.WARNING, logger="engine"):
            async with Engine(config(envs, rubrics, server, path, busy_timeout=0.2)) as eng:
                assert await eng.score([judged("graded", "4"), judged("graded", "6")]) == [0.4, 0.6]
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    skipped = [r for r in caplog.records if "not stored" in r.getMessage()]
    assert len(skipped) == 1 and "locked" in skipped[0].getMessage()
    async with Engine(config(envs, rubrics, server, path)) as eng:
        assert await eng.score([judged("graded", "4")]) == [0.4]
    assert len(server.requests) == 3  # judged again: the lost write cost a call, never a wrong reward


async def test_the_least_recently_used_are_evicted_at_the_bound(serve: Any, envs: Path, rubrics: Path,
                                                                 tmp_path: Path) -> None:
    server = serve()
    add_rubric_env(envs, "graded", ARITH)
    path = tmp_path / "verdicts.sqlite"
    for answers in (["1"], ["2"], ["3"], ["1"], ["4"]):  # "1" used again, so "2" is the least recently used
        async with Engine(config(envs, rubrics, server, path, max_entries=3)) as eng:
            await eng.score([judged("graded", a) for a in answers])
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM verdicts").fetchone() == (3,)
    async with Engine(config(envs, rubrics, server, path, max_entries=3)) as eng:
        result = await eng.run([judged("graded", a) for a in ("1", "3", "4", "2")])
    assert result.verifiers[0].cache_hits == 3 and sorted(result.cached) == [0, 1, 2]  # "2" was judged again


def _config_file(tmp_path: Path, envs: Path, rubrics: Path, server: Server, path: Path) -> Path:
    file = tmp_path / "engine.toml"
    file.write_text(f'environments = "{envs}"\nrubrics = "{rubrics}"\nallow_unpinned = true\n'
                    f'[judge]\nbase_url = "{server.base_url}"\nmodel = "judge-test"\n'
                    f'[cache]\npath = "{path.relative_to(tmp_path)}"\n')
    return file


def test_cache_stats_and_clear_one_verifier_and_a_cached_rewards_provenance_in_engine_score(
    serve: Any, envs: Path, rubrics: Path, tmp_path: Path
) -> None:
    server = serve()
    add_rubric_env(envs, "graded", ARITH)
    add_rubric_env(envs, "helpful", HELP)
    config_file = _config_file(tmp_path, envs, rubrics, server, tmp_path / "verdicts.sqlite")
    rows = [{"id": 1, **judged("graded", "3")}, {"id": 2, **judged("helpful", "5")}, {"id": 3, **judged("graded", "3")}]
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(map(orjson.dumps, rows)) + b"\n")
    runner = CliRunner()

    def score(out: str) -> list[dict[str, Any]]:
        result = runner.invoke(cli, ["score", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / out),
                                     "--config", str(config_file)])
        assert result.exit_code == 0, result.output
        return [orjson.loads(line) for line in (tmp_path / out).read_bytes().splitlines()]

    first, second = score("first.jsonl"), score("second.jsonl")
    assert len(server.requests) == 2
    assert [row["reward"] for row in first] == [row["reward"] for row in second] == [0.3, 1.0, 0.3]
    assert all("cached" not in row["verifier"] for row in first)
    assert all(isinstance(row["verifier"]["cached"], float) for row in second)
    assert second[0]["verifier"]["prompt"] == PROMPT_VERSION and second[0]["verifier"]["model"] == "judge-test"

    stats = runner.invoke(cli, ["cache", "stats", "--config", str(config_file)])
    assert stats.exit_code == 0, stats.output
    assert "2 verdicts" in stats.output and f"{ARITH}  1 verdict, 2 hits" in stats.output
    assert f"{HELP}  1 verdict, 1 hit" in stats.output
    cleared = runner.invoke(cli, ["cache", "clear", "--verifier", HELP, "--config", str(config_file)])
    assert cleared.exit_code == 0 and "1 verdict of bob/helpfulness deleted" in cleared.output
    score("third.jsonl")
    assert len(server.requests) == 3  # only bob/helpfulness's item judged again
