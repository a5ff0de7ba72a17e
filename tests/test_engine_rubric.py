"""Rubric verifiers through the engine's public API, against a real OpenAI-compatible judge on 127.0.0.1.

The judge server (``Server.judge`` in ``tests/servers.py``) grades each request by what it reads in it: the score is
the item's response text (a number), so rewards are checked item by item whatever order the requests
arrive in, and a few marker responses (``BROKEN``) ask for a broken reply. Every reply carries a
``usage`` derived from the score, so a batch's token count can be computed from its items.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import SleepRecorder, add_rubric_env, import_count, item
from servers import Request, Response, Server, assert_rate_held, completion, judges, score, status

from engine import (
    BatchResult,
    BlockingEngine,
    ConfigError,
    Engine,
    EngineConfig,
    JudgeConfig,
    Limits,
    VerificationError,
    digest_directory,
)

RUBRICS = Path(__file__).parent / "rubrics"
ARITH = "alice/arithmetic-correctness"  # version 1 on [0, 1], version 2 (latest) on [0, 10]
HELP = "bob/helpfulness"  # version 1 on [1, 5]
V1_MARK = "Score 1 when the response's final answer equals the reference answer"
V2_MARK = "Arithmetic correctness, with partial credit"
KEY_VAR = "ENGINE_TEST_JUDGE_KEY"
PROMPT = "What is 6 * 7?"

BROKEN: dict[str, Response] = {
    "no-score": completion('{"reason": "looks right"}'),
    "out-of-range": score(11),
    "empty": completion(""),
}


# --- the judge's side ----------------------------------------------------------------------------


def section(text: str, tag: str) -> str:
    """The text between ``<tag>`` and ``</tag>`` in a prompt."""
    return text.split(f"<{tag}>\n", 1)[1].split(f"\n</{tag}>", 1)[0]


def user_message(request: Request) -> str:
    return str(next(m["content"] for m in request.json()["messages"] if m["role"] == "user"))


def response_of(request: Request) -> str:
    """The item's flattened trajectory, as the judge received it."""
    return section(user_message(request), "response")


def rubric_of(request: Request) -> str:
    """The rubric text the judge was asked to apply."""
    return section(user_message(request), "rubric")


def usage_for(value: int) -> dict[str, int]:
    return {"prompt_tokens": 100 + value, "completion_tokens": 3, "total_tokens": 103 + value}


def by_response(request: Request) -> Response:
    """Score the item with the number it answered, or reply as ``BROKEN`` says for a marker."""
    text = response_of(request)
    if text in BROKEN:
        return BROKEN[text]
    value = int(text)
    return score(value, usage=usage_for(value))


def graded(server: Server) -> dict[str, list[str]]:
    """Response text -> the rubric texts the judge received for it, one per request."""
    seen: dict[str, list[str]] = {}
    for request in server.requests:
        seen.setdefault(response_of(request), []).append(rubric_of(request))
    return seen


# --- fixtures and helpers ------------------------------------------------------------------------


@pytest.fixture
def serve() -> Iterator[Any]:
    """``serve(*script, default=...)`` starts a judge server, stopped when the test ends."""
    with judges(default=by_response) as start:
        yield start


@pytest.fixture
def rubrics(tmp_path: Path) -> Path:
    """A private copy of ``tests/rubrics``: a test may add versions to it."""
    target = tmp_path / "rubrics"
    shutil.copytree(RUBRICS, target)
    return target


def judge_config(base_url: str, **settings: Any) -> JudgeConfig:
    return JudgeConfig(base_url=base_url, model="judge-test", **settings)


def engine_config(envs: Path, rubrics: Path, judge: JudgeConfig | None, **settings: Any) -> EngineConfig:
    return EngineConfig(environments=envs, rubrics=rubrics, allow_unpinned=True, judge=judge, **settings)


def judged(environment: str, answer: str, item_id: Any = None) -> dict[str, Any]:
    """A rubric item whose response is ``answer`` (the judge server scores it with that number)."""
    return item(environment, answer, item_id, prompt=PROMPT, reference="42")


def file_digest(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def without_judge(provenance: Any) -> dict[str, Any]:
    """A provenance without what it says of the judge and the prompt (tests/test_cache.py checks those)."""
    return {key: value for key, value in provenance.items() if key not in ("prompt", "model", "judge")}


def provenance(rubrics: Path, ref: str, version: int) -> dict[str, Any]:
    """What a batch should report for an item judged against version ``version`` of ``ref``."""
    path = rubrics / ref / f"{version}.md"
    return {"kind": "rubric", "ref": f"{ref}@{version}", "version": version, "digest": file_digest(path)}


async def failed_run(eng: Engine, items: list[dict[str, Any]]) -> VerificationError:
    """Run a batch that must fail; there is no result to look at, only the error."""
    with pytest.raises(VerificationError) as info:
        await eng.run(items)
    return info.value


# --- versions ------------------------------------------------------------------------------------


async def test_latest_and_pinned_refs_are_judged_against_their_own_version(
    serve: Any, envs: Path, rubrics: Path
) -> None:
    server = serve()
    add_rubric_env(envs, "latest", ARITH)
    add_rubric_env(envs, "pinned", f"{ARITH}@1")
    batch = [judged("latest", "7"), judged("pinned", "1"), judged("latest", "3"), judged("pinned", "0")]
    async with Engine(engine_config(envs, rubrics, judge_config(server.base_url))) as eng:
        result = await eng.run(batch)
    assert result.rewards == [0.7, 1.0, 0.3, 0.0]  # 7 and 3 on [0, 10]; 1 and 0 on [0, 1]

    seen = graded(server)
    assert sorted(seen) == ["0", "1", "3", "7"] and all(len(texts) == 1 for texts in seen.values())
    for answer in ("7", "3"):
        assert V2_MARK in seen[answer][0] and V1_MARK not in seen[answer][0]
    for answer in ("1", "0"):
        assert V1_MARK in seen[answer][0] and V2_MARK not in seen[answer][0]
    scales = {response_of(r): r.json()["messages"][0]["content"] for r in server.requests}
    assert "from 0 (worst) to 10 (best)" in scales["7"] and "from 0 (worst) to 1 (best)" in scales["1"]
    assert all(f"<task>\n{PROMPT}\n</task>" in user_message(r) for r in server.requests)
    assert all("<reference>\n42\n</reference>" in user_message(r) for r in server.requests)

    latest, pinned = provenance(rubrics, ARITH, 2), provenance(rubrics, ARITH, 1)
    assert [without_judge(result.provenance(i)) for i in range(4)] == [latest, pinned, latest, pinned]
    assert latest["digest"] != pinned["digest"]
    reports = {report.ref: report for report in result.verifiers}
    assert sorted(reports) == [f"{ARITH}@1", f"{ARITH}@2"]
    assert {report.key for report in result.verifiers} == {ARITH}
    assert (reports[f"{ARITH}@2"].items, reports[f"{ARITH}@2"].reward_sum) == (2, pytest.approx(1.0))


async def test_a_mixed_batch_of_rubric_and_plugin_items_keeps_input_order(
    serve: Any, envs: Path, rubrics: Path
) -> None:
    server = serve()
    add_rubric_env(envs, "latest", ARITH)
    add_rubric_env(envs, "helpful", HELP)
    batch = [
        item("arith", "42", reference="42"),
        judged("latest", "2"),
        judged("helpful", "5"),
        item("arith", "41", reference="42"),
        judged("latest", "9"),
        judged("helpful", "1"),
        item("arith", " 42. ", reference="42"),
        judged("latest", "5"),
    ]
    async with Engine(engine_config(envs, rubrics, judge_config(server.base_url))) as eng:
        result = await eng.run(batch)
    assert result.rewards == [1.0, 0.2, 1.0, 0.0, 0.9, 0.0, 1.0, 0.5]
    assert len(server.requests) == 5  # the plugin items never reach the judge
    digest = digest_directory(envs / "arith")
    arith = {"kind": "plugin", "ref": "verify:score", "environment": "arith", "digest": digest}
    expected = [arith, provenance(rubrics, ARITH, 2), provenance(rubrics, HELP, 1)] * 2 + [
        arith, provenance(rubrics, ARITH, 2)
    ]
    assert [without_judge(result.provenance(i)) for i in range(len(batch))] == expected
    assert result.usage["requests"] == 5


async def test_a_version_added_mid_batch_does_not_split_the_batch(serve: Any, envs: Path, rubrics: Path) -> None:
    version3 = rubrics / ARITH / "3.md"

    def add_a_version_then_grade(request: Request) -> Response:
        if not version3.exists():
            version3.write_text("+++\nscale = [0, 100]\n+++\nVERSION THREE: a stricter standard.\n")
        return by_response(request)

    server = serve(default=add_a_version_then_grade)
    add_rubric_env(envs, "latest", ARITH)
    add_rubric_env(envs, "latest_too", ARITH)  # a second environment on the same rubric
    answers = ["1", "2", "3", "4", "5", "6"]
    batch = [judged("latest" if i % 2 else "latest_too", answer) for i, answer in enumerate(answers)]
    # One call at a time, so every request after the first is built after version 3 was written.
    config = engine_config(envs, rubrics, judge_config(server.base_url), refs={ARITH: Limits(max_concurrency=1)})
    version2_text = (RUBRICS / ARITH / "2.md").read_text().split("+++")[2].strip()
    async with Engine(config) as eng:
        first = await eng.run(batch)
        assert version3.exists() and server.max_in_flight == 1
        assert len(server.requests) == len(batch)
        assert [rubric_of(r) for r in server.requests] == [version2_text] * len(batch)
        assert first.rewards == [int(a) / 10 for a in answers]  # on version 2's [0, 10]
        assert all(without_judge(first.provenance(i)) == provenance(rubrics, ARITH, 2) for i in range(len(batch)))
        assert [report.ref for report in first.verifiers] == [f"{ARITH}@2"]

        second = await eng.run(batch)
    later = server.requests[len(batch) :]
    assert [rubric_of(r) for r in later] == ["VERSION THREE: a stricter standard."] * len(batch)
    assert second.rewards == [int(a) / 100 for a in answers]  # on version 3's [0, 100]
    assert all(without_judge(second.provenance(i)) == provenance(rubrics, ARITH, 3) for i in range(len(batch)))


# --- usage ---------------------------------------------------------------------------------------


async def test_token_usage_is_summed_per_batch(
    serve: Any, envs: Path, rubrics: Path, sleeps: SleepRecorder
) -> None:
    server = serve(status(429, retry_after="0.25"))  # one retry, which costs a request but no tokens
    add_rubric_env(envs, "latest", ARITH)
    add_rubric_env(envs, "helpful", HELP)
    first_batch = [judged("latest", "2"), item("arith", "42", reference="42"), judged("helpful", "3"),
                   judged("latest", "4"), judged("helpful", "5")]
    second_batch = [judged("latest", "1"), judged("latest", "1")]  # judged twice: dedupe is off
    config = engine_config(envs, rubrics, judge_config(server.base_url, dedupe=False))
    async with Engine(config, sleep=sleeps) as eng:
        first = await eng.run(first_batch)
        second = await eng.run(second_batch)
        plugins_only = await eng.run([item("arith", "42", reference="42")])
    assert first.rewards == [0.2, 1.0, 0.5, 0.4, 1.0]
    assert dict(first.usage) == {
        "requests": 5, "retries": 1,
        "prompt_tokens": 400 + 2 + 3 + 4 + 5, "completion_tokens": 4 * 3, "total_tokens": 412 + 2 + 3 + 4 + 5,
    }
    # the retry waited its Retry-After; the judge's window paused the first tries sent meanwhile, no longer
    assert sleeps.calls.count(0.25) == 1 and all(0 < seconds <= 0.25 for seconds in sleeps.calls)
    assert sum(report.retries for report in first.verifiers) == 1
    # the second batch's usage is its own, not a running total
    assert dict(second.usage) == {
        "requests": 2, "retries": 0, "prompt_tokens": 202, "completion_tokens": 6, "total_tokens": 208
    }
    assert not any(plugins_only.usage.values())
    assert len(server.requests) == 7


# --- failures ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("marker", "reason"),
    [
        ("no-score", "the judge's reply has no 'score'"),
        ("out-of-range", "the judge's score 11 is outside the rubric's scale [0, 10]"),
        ("empty", "the judge's reply is empty"),
    ],
)
async def test_a_reply_without_a_usable_score_aborts_the_batch(
    serve: Any, envs: Path, rubrics: Path, marker: str, reason: str
) -> None:
    server = serve()
    add_rubric_env(envs, "latest", ARITH)
    batch = [item("arith", "42", reference="42"), judged("latest", "1", "a"), judged("latest", marker, "bad"),
             judged("latest", "3", "c")]
    async with Engine(engine_config(envs, rubrics, judge_config(server.base_url))) as eng:
        err = await failed_run(eng, batch)
        assert type(err) is VerificationError
        assert (err.kind, err.ref, err.index, err.item_id, err.environment) == (
            "rubric", f"{ARITH}@2", 2, "bad", "latest"
        )
        assert reason in err.reason, err.reason
        assert str(err).startswith(f"rubric verifier '{ARITH}@2' (environment 'latest') failed on item 2 (id 'bad')")
        assert len(graded(server)[marker]) == 1  # never retried

        # the engine is still usable, and the next batch's usage is its own
        after = await eng.run([judged("latest", "8"), item("arith", "42", reference="42")])
    assert after.rewards == [0.8, 1.0]
    assert dict(after.usage) == {
        "requests": 1, "retries": 0, "prompt_tokens": 108, "completion_tokens": 3, "total_tokens": 111
    }
    # (counted by answer: a request of the aborted batch may still reach the server after the abort)
    assert len(graded(server)["8"]) == 1


@pytest.mark.parametrize(
    ("ref", "reason"),
    [
        ("nobody/nothing", "no rubric nobody/nothing: no version files"),
        (f"{ARITH}@9", f"rubric {ARITH} has no version 9 (it has 1, 2)"),
        ("carol/upside-down", "scale must be [lo, hi] with lo < hi"),
    ],
)
async def test_a_rubric_that_cannot_be_resolved_aborts_the_batch_before_any_call(
    serve: Any, envs: Path, rubrics: Path, import_log: Path, ref: str, reason: str
) -> None:
    (rubrics / "carol" / "upside-down").mkdir(parents=True)
    (rubrics / "carol" / "upside-down" / "1.md").write_text("+++\nscale = [5, 1]\n+++\nBackwards.\n")
    server = serve()
    add_rubric_env(envs, "latest", ARITH)
    add_rubric_env(envs, "broken", ref)
    batch = [item("import_log"), judged("latest", "1"), judged("broken", "2", "x"), judged("broken", "3", "y")]
    async with Engine(engine_config(envs, rubrics, judge_config(server.base_url))) as eng:
        err = await failed_run(eng, batch)
        assert isinstance(err, VerificationError)
        assert (err.kind, err.ref, err.index, err.item_id, err.environment) == ("rubric", ref, 2, "x", "broken")
        assert reason in err.reason, err.reason
        # resolution comes before any call: nothing was judged, no plugin was even imported
        assert server.requests == [] and import_count(import_log) == 0

        after = await eng.run([item("import_log"), judged("latest", "4")])
    assert after.rewards == [1.0, 0.4]


async def test_no_judge_configured_aborts_a_batch_with_rubric_items(envs: Path, rubrics: Path) -> None:
    add_rubric_env(envs, "latest", ARITH)
    async with Engine(engine_config(envs, rubrics, None)) as eng:
        err = await failed_run(eng, [item("arith", "42", reference="42"), judged("latest", "1", "r")])
        assert (err.kind, err.ref, err.index, err.item_id, err.environment) == ("rubric", ARITH, 1, "r", "latest")
        assert "no [judge] is configured" in err.reason
        assert (await eng.score([item("arith", "42", reference="42")])) == [1.0]


async def test_judge_down_aborts_the_batch(envs: Path, rubrics: Path, sleeps: SleepRecorder) -> None:
    with Server.judge() as gone:
        base_url = gone.base_url  # a port that was just listening and now refuses connections
    add_rubric_env(envs, "latest", ARITH)
    config = engine_config(envs, rubrics, judge_config(base_url, max_attempts=2))
    async with Engine(config, sleep=sleeps) as eng:
        err = await failed_run(eng, [item("arith", "42", reference="42"), judged("latest", "1", "r")])
        assert (err.kind, err.ref, err.index, err.item_id) == ("rubric", f"{ARITH}@2", 1, "r")
        assert "judge request failed: gave up after 2 attempts; last: could not connect" in err.reason, err.reason
        assert len(sleeps.calls) == 1  # one wait between the two attempts, recorded, not slept
        assert (await eng.score([item("arith", "41", reference="42")])) == [0.0]


OUTAGES = {
    "500": ("HTTP 500", 3),
    "503 with Retry-After": ("HTTP 503", 3),
    "refused": ("could not connect", 0),
}


@pytest.mark.parametrize("outage", list(OUTAGES))
async def test_a_judge_outage_mid_batch_beyond_the_retry_budget_aborts_it(
    serve: Any, envs: Path, rubrics: Path, sleeps: SleepRecorder, outage: str
) -> None:
    healthy = 3  # requests answered before the outage
    answered = 0
    server: Server

    def then_an_outage(request: Request) -> Response:
        nonlocal answered
        answered += 1
        if answered <= healthy:
            reply = by_response(request)
            if outage == "refused" and answered == healthy:
                # Stop listening, and have the client drop its kept-alive connection after this
                # reply: from here on every connection attempt is refused.
                server.stop_listening()
                reply.headers["connection"] = "close"
            return reply
        if outage == "500":
            return status(500, body={"error": {"message": "model overloaded"}})
        return status(503, retry_after="2")

    server = serve(default=then_an_outage)
    add_rubric_env(envs, "latest", ARITH)
    batch = [judged("latest", str(i), f"item-{i}") for i in range(8)]
    # one call at a time, so the outage starts at a known item
    config = engine_config(
        envs, rubrics, judge_config(server.base_url, max_attempts=3), refs={ARITH: Limits(max_concurrency=1)}
    )
    last, failed_requests = OUTAGES[outage]
    async with Engine(config, sleep=sleeps) as eng:
        err = await failed_run(eng, batch)
        assert (err.kind, err.ref, err.index, err.item_id) == ("rubric", f"{ARITH}@2", healthy, f"item-{healthy}")
        assert "judge request failed: gave up after 3 attempts; last: " in err.reason, err.reason
        assert last in err.reason, err.reason
        # the first `healthy` items were judged once, the failing one as often as the budget allows,
        # and the rest of the batch never reached the judge
        assert len(server.requests) == healthy + failed_requests
        assert [response_of(r) for r in server.requests[:healthy]] == ["0", "1", "2"]
        assert all(response_of(r) == str(healthy) for r in server.requests[healthy:])
        assert len(sleeps.calls) == 2  # three attempts, two waits, none of them real
        if outage == "503 with Retry-After":
            assert sleeps.calls == [2.0, 2.0]
        if outage == "500":
            assert "model overloaded" in err.reason
        assert (await eng.score([item("arith", "42", reference="42")])) == [1.0]  # still usable


async def test_an_unset_key_variable_aborts_the_batch_before_any_request(
    serve: Any, envs: Path, rubrics: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_VAR, raising=False)
    server = serve()
    add_rubric_env(envs, "latest", ARITH)
    async with Engine(engine_config(envs, rubrics, judge_config(server.base_url, api_key_env=KEY_VAR))) as eng:
        err = await failed_run(eng, [judged("latest", "1", "k")])
        assert (err.kind, err.index, err.item_id) == ("rubric", 0, "k")
        assert f"API key variable {KEY_VAR} is not set" in err.reason
        assert server.requests == []
        monkeypatch.setenv(KEY_VAR, "sk-set-later")  # read per request: setting it now is enough
        assert (await eng.score([judged("latest", "6")])) == [0.6]
    assert server.requests[0].headers["authorization"] == "Bearer sk-set-later"


async def test_a_retry_budget_under_a_rubric_refs_table_is_not_silently_ignored(
    serve: Any, envs: Path, rubrics: Path, sleeps: SleepRecorder
) -> None:
    server = serve(default=status(503))
    add_rubric_env(envs, "latest", ARITH)
    try:
        config = engine_config(envs, rubrics, judge_config(server.base_url), refs={ARITH: Limits(max_attempts=1)})
    except ConfigError as exc:  # refusing the key is as good as honouring it
        assert "max_attempts" in str(exc)
        return
    async with Engine(config, sleep=sleeps) as eng:
        err = await failed_run(eng, [judged("latest", "1")])
    assert "HTTP 503" in err.reason
    assert len(server.requests) == 1, f"{len(server.requests)} attempts under a budget of 1"


# --- configuration from a file -------------------------------------------------------------------


def write_config(tmp_path: Path, base_url: str) -> Path:
    """An engine.toml with a [judge] table; every path in it is relative to the file."""
    path = tmp_path / "engine.toml"
    path.write_text(
        f"""\
environments = "envs"
rubrics = "rubrics"
allow_unpinned = true

[judge]
base_url = "{base_url}"
model = "qwen3-8b"
api_key_env = "{KEY_VAR}"
max_concurrency = 4
max_tokens = 64
timeout = 5

[refs."{ARITH}"]
max_concurrency = 2
"""
    )
    return path


def check_requests(server: Server, answers: list[str]) -> None:
    assert sorted(response_of(r) for r in server.requests) == sorted(answers)
    for request in server.requests:
        assert request.headers["authorization"] == "Bearer sk-from-the-environment"
        body = request.json()
        assert (body["model"], body["max_tokens"]) == ("qwen3-8b", 64)
    assert server.max_in_flight <= 2  # [refs."alice/arithmetic-correctness"] max_concurrency


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from a directory with no envs or rubrics in it, and the judge's key in its variable."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv(KEY_VAR, "sk-from-the-environment")


@pytest.mark.usefixtures("elsewhere", "rubrics")
async def test_a_toml_config_with_a_judge_loads_and_scores(serve: Any, envs: Path, tmp_path: Path) -> None:
    server = serve()
    add_rubric_env(envs, "latest", ARITH)
    path = write_config(tmp_path, server.base_url)
    assert "sk-from-the-environment" not in path.read_text()
    answers = ["1", "9", "4", "7", "10"]
    async with Engine.from_config(path) as eng:
        assert eng.config.rubrics == tmp_path / "rubrics" and eng.config.judge is not None
        result = await eng.run([judged("latest", a) for a in answers] + [item("arith", "42", reference="42")])
    assert result.rewards == [0.1, 0.9, 0.4, 0.7, 1.0, 1.0]
    assert without_judge(result.provenance(0)) == provenance(tmp_path / "rubrics", ARITH, 2)
    check_requests(server, answers)


@pytest.mark.usefixtures("elsewhere", "rubrics")
def test_a_toml_config_with_a_judge_works_from_blocking_code(serve: Any, envs: Path, tmp_path: Path) -> None:
    server = serve()
    add_rubric_env(envs, "pinned", f"{ARITH}@1")
    with BlockingEngine.from_config(write_config(tmp_path, server.base_url)) as eng:
        assert eng.score([judged("pinned", "1"), judged("pinned", "0")]) == [1.0, 0.0]
        assert eng.score([judged("pinned", "0")]) == [0.0]
    assert all(V1_MARK in rubric_of(r) for r in server.requests)
    check_requests(server, ["1", "0", "0"])


def test_blocking_callers_get_usage_and_provenance(serve: Any, envs: Path, rubrics: Path) -> None:
    server = serve()
    add_rubric_env(envs, "latest", ARITH)
    with BlockingEngine(engine_config(envs, rubrics, judge_config(server.base_url))) as eng:
        result = eng.run([judged("latest", "2"), judged("latest", "3")])
    assert result.rewards == [0.2, 0.3]
    assert without_judge(result.provenance(1)) == provenance(rubrics, ARITH, 2)
    assert result.usage["total_tokens"] == 105 + 106


# --- limits --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(15)
async def test_the_judge_rate_limit_holds_across_a_batch(serve: Any, envs: Path, rubrics: Path) -> None:
    rate, count = 20.0, 40
    server = serve()
    add_rubric_env(envs, "latest", ARITH)
    add_rubric_env(envs, "helpful", HELP)
    # two rubrics, each with a lane of its own: the judge's rate limit is over both
    batch = [judged("latest", str(i % 11)) if i % 2 else judged("helpful", str(1 + i % 5)) for i in range(count)]
    # identical items among them: dedupe is off, so each is a request
    config = engine_config(envs, rubrics, judge_config(server.base_url, max_rate=rate, max_concurrency=count,
                                                       dedupe=False))
    async with Engine(config) as eng:
        since = time.monotonic()
        result: BatchResult = await eng.run(batch)
    assert result.rewards == [(i % 11) / 10 if i % 2 else (i % 5) / 4 for i in range(count)]
    assert_rate_held(server, count, rate, since)


async def test_one_engine_scores_concurrent_batches_each_with_its_own_usage(
    serve: Any, envs: Path, rubrics: Path
) -> None:
    server = serve()
    add_rubric_env(envs, "latest", ARITH)
    results: dict[str, BatchResult] = {}

    async with Engine(engine_config(envs, rubrics, judge_config(server.base_url))) as eng:

        async def run(name: str, answers: list[str]) -> None:
            results[name] = await eng.run([judged("latest", a) for a in answers])

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "small", ["1"])
            tg.start_soon(run, "large", ["2", "3", "4"])
    assert results["small"].rewards == [0.1] and results["large"].rewards == [0.2, 0.3, 0.4]
    assert results["small"].usage["total_tokens"] == 104
    assert results["large"].usage["total_tokens"] == 105 + 106 + 107
    assert (results["small"].usage["requests"], results["large"].usage["requests"]) == (1, 3)
