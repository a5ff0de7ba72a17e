"""``Engine.connect``'s client facing a service that lies, hangs or echoes: real servers on 127.0.0.1.

Each server here (``tests/servers.py``) answers crafted bytes to a real client: a count that is not the
batch's, a malformed result, a body that is not JSON, an error without its fields, a 503 whose
``Retry-After`` asks for no wait, a request never answered, a body echoing the token. The client raises
``ServiceError`` saying what was wrong, waits the backoff at least, gives up at its timeout, and never
repeats the token; a token no header can carry is the caller's ``ValueError``, before anything is sent.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import orjson
import pytest
from conftest import SleepRecorder
from servers import Request, Response, Server

import engine
from engine import ServiceError
from engine._http.retry import BACKOFF_BASE, BACKOFF_MAX

pytestmark = pytest.mark.timeout(60)

SECRET = "Zq9-unguessable-S3CRET-token"  # a token searched for in every error the client raises
ITEMS = [{"environment": "arith", "task": {"n": n}, "trajectory": str(n)} for n in range(3)]
WIDE = 2**64 + 1  # an integer orjson would refuse to write and read as a rounded float


def report(items: int, reward_sum: float) -> dict[str, Any]:
    """One verifier's report as ``engine serve`` writes it."""
    return {
        "kind": "plugin", "ref": "arith", "key": "plugin:arith", "provenance": {"kind": "plugin", "digest": "ab"},
        "items": items, "reward_sum": reward_sum, "latencies": [0.001], "latency_items": [items], "waited": 0.0,
        "busy": 0.001, "peak_in_flight": 1, "retries": 0, "active": 0.001, "startup": [], "spent": {},
        "window": None,
    }


def answer(rewards: list[float]) -> dict[str, Any]:
    """A well-formed answer with ``rewards``: one verifier scored every item."""
    return {"rewards": rewards, "verifiers": [report(len(rewards), sum(rewards))], "elapsed": 0.01,
            "verifier_of": [0] * len(rewards), "usage": {}}


def replying(*responses: Response) -> Callable[[Request], Any]:
    """A handler answering ``responses`` in turn, the last one for every further request."""
    queue = list(responses)

    async def handle(request: Request) -> Response:
        return queue.pop(0) if len(queue) > 1 else queue[0]

    return handle


@pytest.fixture
def lying() -> Iterator[Callable[..., Server]]:
    """``lying(*responses)``: a server on 127.0.0.1 answering them in turn; stopped when the test ends."""
    started: list[Server] = []

    def start(*responses: Response) -> Server:
        server = Server(replying(*responses)).__enter__()
        started.append(server)
        return server

    yield start
    for server in started:
        server.__exit__(None, None, None)


async def score_through(server: Server, items: list[dict[str, Any]] = ITEMS, **kwargs: Any) -> Any:
    async with engine.Engine.connect(server.url, **kwargs) as eng:
        return await eng.run(items)


async def service_error(server: Server, items: list[dict[str, Any]] = ITEMS, **kwargs: Any) -> ServiceError:
    with pytest.raises(ServiceError) as info:
        await score_through(server, items, **kwargs)
    return info.value


def chain_text(exc: BaseException) -> str:
    """The str and repr of an error and of every error it chains (cause and context)."""
    texts, seen, todo = [], set(), [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        texts += [str(current), repr(current), *map(str, current.args)]
        todo += [link for link in (current.__cause__, current.__context__) if link is not None]
    return "\n".join(texts)


# --- case 2: the answer is checked against the batch sent -------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 4, 0])
async def test_an_answer_with_rewards_short_or_over_is_a_service_error(
    lying: Callable[..., Server], count: int
) -> None:
    server = lying(Response.json(answer([0.5] * count)))  # well-formed in itself: only the count is wrong
    err = await service_error(server)
    assert f"answered {count} rewards for 3 items sent" in str(err), err
    assert server.url in str(err) and err.status == 200
    async with engine.Engine.connect(server.url) as eng:
        with pytest.raises(ServiceError, match="rewards for 3 items sent"):
            await eng.score(ITEMS)
    with engine.BlockingEngine.connect(server.url) as blocking, pytest.raises(ServiceError, match="for 3 items sent"):
        blocking.score(ITEMS)


def malformed(change: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    data = answer([0.25, 0.5, 1.0])
    change(data)
    return data


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], object]:
    """A change that sets ``data[a][b]...`` (a path of keys and list indices, dotted) to ``value``."""
    *parents, last = [int(part) if part.isdigit() else part for part in path.split(".")]

    def change(data: dict[str, Any]) -> None:
        node: Any = data
        for part in parents:
            node = node[part]
        node[last] = value

    return change


MALFORMED = {
    "verifier_of names no report": (_set("verifier_of", [0, 1, 0]), "verifier_of[1] is 1, not the index of one of"),
    "verifier_of a negative index": (_set("verifier_of", [0, -1, 0]), "verifier_of[1] is -1"),
    "verifier_of a bool": (_set("verifier_of", [0, True, 0]), "verifier_of[1] is a bool"),
    "verifier_of a float": (_set("verifier_of", [0, 0.0, 0]), "verifier_of[1] is 0.0"),
    "verifier_of too short": (_set("verifier_of", [0, 0]), "its verifier_of is 2 entries, not one verifier's index"),
    "verifier_of not a list": (_set("verifier_of", {"0": 0}), "its verifier_of is a dict"),
    "a reward that is a string": (_set("rewards.1", "0.5"), "reward 1 is a str, not a finite float"),
    "a reward that is a bool": (_set("rewards.1", True), "reward 1 is a bool"),
    "a reward that is an int": (_set("rewards.1", 1), "reward 1 is 1, not a finite float"),
    "a reward that is null": (_set("rewards.1", None), "reward 1 is null"),
    "rewards not a list": (_set("rewards", {"a": 1.0}), "its rewards are a dict, not a list"),
    "elapsed negative": (_set("elapsed", -1.0), "its elapsed is -1.0, not a finite float >= 0"),
    "elapsed a string": (_set("elapsed", "0.1"), "its elapsed is a str"),
    "usage a list": (_set("usage", [1]), "its usage is not an object of whole numbers"),
    "usage not counts": (_set("usage", {"total_tokens": "many"}), "its usage is not an object of whole numbers"),
    "a report lacking a field": (lambda data: data["verifiers"][0].pop("busy"), "verifier report 0 lacks busy"),
    "a report with a field too many": (_set("verifiers.0.extra", 1), "verifier report 0 has unknown 'extra'"),
    "a report's items a bool": (_set("verifiers.0.items", True), "verifier report 0's items is a bool"),
    "a report's items not its items": (_set("verifiers.0.items", 5), "verifier report 0 counts 5 items; verifier_of"),
    "a report's latencies strings": (_set("verifiers.0.latencies", ["1"]), "report 0's latencies is not a list"),
    "a report's busy a string": (_set("verifiers.0.busy", "1"), "report 0's busy is a str, not a finite number"),
    "a report's reward_sum a bool": (_set("verifiers.0.reward_sum", False), "report 0's reward_sum is a bool"),
    "a report's provenance a string": (_set("verifiers.0.provenance", "x"), "report 0's provenance is a str"),
    "a report's kind null": (_set("verifiers.0.kind", None), "report 0's kind is null, not a string"),
    "a report not an object": (_set("verifiers.0", [1]), "verifier report 0 is a list, not an object"),
    "no verifiers": (lambda data: data.pop("verifiers"), "the answer lacks verifiers"),
    "a key too many": (_set("more", 1), "the answer has unknown 'more'"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_a_malformed_answer_is_a_service_error_saying_what_was_wrong(
    lying: Callable[..., Server], case: str
) -> None:
    change, said = MALFORMED[case]
    err = await service_error(lying(Response.json(malformed(change))))
    assert "answered something that is not a batch's result" in str(err), err
    assert said in str(err), err
    assert err.status == 200


@pytest.mark.parametrize("body", [b"[1.0, 2.0, 3.0]", b"null", b'"rewards"'])
async def test_an_answer_that_is_not_an_object_is_a_service_error(lying: Callable[..., Server], body: bytes) -> None:
    err = await service_error(lying(Response(200, body, {"content-type": "application/json"})))
    assert "not an object" in str(err), err


async def test_a_well_formed_answer_is_read_exactly(lying: Callable[..., Server]) -> None:
    server = lying(Response.json(answer([0.25, 0.5, 1.0])))
    result = await score_through(server)
    assert result.rewards == [0.25, 0.5, 1.0] and result.verifier_of == [0, 0, 0]
    assert [dict(result.provenance(i)) for i in range(3)] == [{"kind": "plugin", "digest": "ab"}] * 3


async def test_a_reward_sum_that_overflowed_is_read_as_nan_and_a_wide_integer_as_it_is(
    lying: Callable[..., Server]
) -> None:
    data = answer([1e308, 1e308, 1e308])
    data["verifiers"][0]["reward_sum"] = None  # the service's sum was an infinity, which orjson writes as null
    result = await score_through(lying(Response.json(data)))
    assert result.rewards == [1e308] * 3 and math.isnan(result.verifiers[0].reward_sum)
    data = answer([1.0, 1.0, 1.0])
    data["verifiers"][0]["busy"] = 10**30  # a whole number wider than orjson reads: exact, still seconds
    body = json.dumps(data).encode()
    assert (await score_through(lying(Response(200, body)))).verifiers[0].busy == 10**30


def test_the_trl_adapter_raises_on_an_answer_with_a_reward_short(lying: Callable[..., Server]) -> None:
    from engine.adapters import close_engines
    from engine.adapters.trl import EngineReward

    server = lying(Response.json(answer([1.0])))
    reward = EngineReward(url=server.url, environment="arith")
    try:
        with pytest.raises(ServiceError, match="answered 1 rewards for 2 items sent"):
            reward(prompts=["a", "b"], completions=["4", "5"])  # never a list of one handed to TRL
    finally:
        close_engines()


# --- case 9: what is not an answer is a ServiceError saying what came --------------------------------------


async def test_a_200_that_is_not_json_is_a_service_error_quoting_it(lying: Callable[..., Server]) -> None:
    server = lying(Response(200, b"<html>\n  <body>maintenance</body>\n</html>", {"content-type": "text/html"}))
    err = await service_error(server)
    assert "answered HTTP 200 with a body that is not JSON" in str(err), err
    assert "<html> <body>maintenance</body> </html>" in str(err), err
    assert not isinstance(err, ValueError)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("where", ["a reward", "elapsed", "a report's busy"])
async def test_an_answer_holding_a_number_json_cannot_mean_is_a_service_error(
    lying: Callable[..., Server], number: str, where: str
) -> None:
    """No reward, figure or time that is not a finite number is read: the body is refused as a whole."""
    placeholder = 0.123456789
    data = answer([0.5, 0.5, 0.5])
    if where == "a reward":
        data["rewards"][1] = placeholder
    elif where == "elapsed":
        data["elapsed"] = placeholder
    else:
        data["verifiers"][0]["busy"] = placeholder
    body = json.dumps(data).replace(repr(placeholder), number).encode()
    assert number.encode() in body
    err = await service_error(lying(Response(200, body, {"content-type": "application/json"})))
    assert "answered HTTP 200 with a body that is not JSON" in str(err), err
    assert err.status == 200


@pytest.mark.parametrize(
    "error",
    [
        {"type": "VerificationError", "message": "boom"},  # no kind, no ref
        {"type": "VerificationError", "kind": None, "ref": "x", "message": "boom"},
        {"type": "RubricError", "message": "boom"},  # no ref
        {"type": "ValueError"},  # no message
        {"message": "boom"},  # no type
        "boom",  # not an object
    ],
)
async def test_an_error_body_without_its_fields_is_a_service_error(lying: Callable[..., Server], error: Any) -> None:
    err = await service_error(lying(Response.json({"error": error}, status=422)))
    assert "answered HTTP 422" in str(err), err
    assert ("boom" in str(err)) == ("boom" in str(error)), err  # what the service sent, quoted
    assert err.status == 422


async def test_a_well_formed_error_is_still_the_error_it_stands_for(lying: Callable[..., Server]) -> None:
    error = {"type": "VerificationError", "kind": "plugin", "ref": "arith", "key": "arith/arith",
             "environment": "arith", "index": 1, "item_id": "b", "timed_out": False, "cannot_load": False,
             "message": "the plugin raised"}
    with pytest.raises(engine.VerificationError) as info:
        await score_through(lying(Response.json({"error": error}, status=422)))
    assert (info.value.kind, info.value.ref, info.value.index, info.value.reason) == ("plugin", "arith", 1,
                                                                                      "the plugin raised")


BAD_TOKENS = {
    "a non-ASCII character at position 7 of 29": SECRET[:6] + "é" + SECRET[6:],
    "a newline at its end": SECRET + "\n",
    "a carriage return at its end": SECRET + "\r",
    "a space at its start": " " + SECRET,
    "a tab at position 4 of 29": SECRET[:3] + "\t" + SECRET[3:],
    "a space at position 10 of 29": SECRET[:9] + " " + SECRET[9:],
    "a control character (0x00) at position 2 of 29": SECRET[:1] + "\x00" + SECRET[1:],
    "a control character (0x7f) at its end": SECRET + "\x7f",
}


@pytest.mark.parametrize("said", sorted(BAD_TOKENS))
def test_a_token_no_header_can_carry_is_a_value_error_that_does_not_hold_it(said: str) -> None:
    token = BAD_TOKENS[said]
    for connect in (engine.Engine.connect, engine.BlockingEngine.connect):
        with pytest.raises(ValueError) as info:  # at construction: nothing is sent, nothing opened
            connect("http://127.0.0.1:9", token=token)
        message = chain_text(info.value)
        assert f"the token holds {said}" in message, message
        assert "0x21-0x7e" in message
        assert SECRET[:8] not in message and SECRET[-8:] not in message and token not in message


def test_an_empty_token_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="the token is empty"):
        engine.Engine.connect("http://127.0.0.1:9", token="")


async def test_every_printable_ascii_character_is_a_valid_token(lying: Callable[..., Server]) -> None:
    token = "".join(map(chr, range(0x21, 0x7F)))
    server = lying(Response.json(answer([1.0, 1.0, 1.0])))
    assert (await score_through(server, token=token)).rewards == [1.0, 1.0, 1.0]
    assert server.requests[0].headers["authorization"] == f"Bearer {token}"


# --- case 8: no message carries the token ------------------------------------------------------------------


def _echo_headers(status: int, **headers: str) -> Callable[[Request], Any]:
    """A stranger echoing the request's headers, raw and as JSON, in its answer's body."""

    async def handle(request: Request) -> Response:
        echoed = request.headers["authorization"].encode() + b" " + orjson.dumps(request.headers)
        return Response(status, echoed, headers)

    return handle


@pytest.mark.parametrize(
    "handler",
    [
        _echo_headers(200),  # not JSON
        _echo_headers(401),
        _echo_headers(502),
        _echo_headers(503, **{"retry-after": "0"}),  # saturated until the budget is spent
    ],
    ids=["200", "401", "502", "503"],
)
async def test_no_error_repeats_the_token_a_stranger_echoes(handler: Callable[[Request], Any]) -> None:
    with Server(handler) as stranger, pytest.raises(ServiceError) as info:
        await score_through(stranger, token=SECRET, retry_budget=0.3)
    assert SECRET in stranger.requests[0].headers["authorization"]  # it was sent, and echoed back
    text = chain_text(info.value)
    assert "[redacted]" in text, text
    assert SECRET not in text and SECRET[:12] not in text, text


@pytest.mark.parametrize(
    "body",
    [
        lambda: {**answer([1.0, 1.0, 1.0]), SECRET: 1},  # the token as a key the answer should not have
        lambda: {"error": {"type": "Unauthorized", "message": f"token {SECRET} is wrong"}},
        lambda: {"error": {"type": "VerificationError", "message": f"Bearer {SECRET}"}},  # no kind: not an error
        lambda: {"error": {"type": "VerificationError", "kind": "plugin", "ref": SECRET, "key": SECRET,
                           "timed_out": False, "cannot_load": False, "item_id": f"/{SECRET}/",
                           "message": f'"Bearer {SECRET}"'}},  # an error's every field, JSON-escaped too
        lambda: {"error": {"type": "ValueError", "message": f"bad token {SECRET}"}},
    ],
    ids=["unknown-key", "refusal", "malformed-error", "verification-error", "value-error"],
)
async def test_no_error_repeats_the_token_in_a_json_answer(
    lying: Callable[..., Server], body: Callable[[], dict[str, Any]]
) -> None:
    data = body()
    server = lying(Response.json(data, status=200 if "rewards" in data else 422))
    with pytest.raises((ServiceError, engine.VerificationError, ValueError)) as info:  # or the error it stands for
        await score_through(server, token=SECRET)
    text = chain_text(info.value) + repr(vars(info.value))
    assert "[redacted]" in text and SECRET not in text, text


async def test_no_error_repeats_the_token_when_the_service_is_unreachable_or_silent() -> None:
    with Server.full() as full, Server(_never) as silent:  # a connect that hangs; an answer that never comes
        for url, timeout in ((f"http://127.0.0.1:{_closed_port()}", 5.0), (full.url, 0.3), (silent.url, 0.3)):
            async with engine.Engine.connect(url, token=SECRET, timeout=timeout) as eng:
                with pytest.raises(ServiceError) as info:
                    await eng.score(ITEMS)
            text = chain_text(info.value)
            assert SECRET not in text and "authorization" not in text.lower(), text


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# --- case 10: Retry-After never below the backoff ----------------------------------------------------------


def floor(attempt: int) -> float:
    """The least backoff before try ``attempt + 1`` (half the step: the jitter's bottom)."""
    return min(BACKOFF_MAX, BACKOFF_BASE * 2 ** (attempt - 1)) / 2


@pytest.mark.parametrize("retry_after", ["0", "-1", "nan", "inf", "-inf", "0.0001"])
async def test_a_503_asking_for_no_wait_is_waited_for_the_backoff_at_least(
    lying: Callable[..., Server], sleeps: SleepRecorder, retry_after: str
) -> None:
    busy = Response.json({"error": {"type": "Saturated", "message": "busy"}}, 503, {"retry-after": retry_after})
    server = lying(*[busy] * 6, Response.json(answer([1.0, 1.0, 1.0])))
    assert (await score_through(server, sleep=sleeps)).rewards == [1.0, 1.0, 1.0]
    assert len(server.requests) == 7 and len(sleeps.calls) == 6
    for attempt, wait in enumerate(sleeps.calls, start=1):
        assert wait >= floor(attempt), (attempt, sleeps.calls)


async def test_a_503_asking_for_a_longer_wait_is_waited_for_as_asked(
    lying: Callable[..., Server], sleeps: SleepRecorder
) -> None:
    busy = Response.json({"error": {"type": "Saturated", "message": "busy"}}, 503, {"retry-after": "2"})
    server = lying(busy, busy, Response.json(answer([1.0, 1.0, 1.0])))
    await score_through(server, sleep=sleeps)
    assert sleeps.calls == [2.0, 2.0]


async def test_a_client_facing_retry_after_0_makes_a_handful_of_requests_in_a_second(
    lying: Callable[..., Server]
) -> None:
    busy = Response.json({"error": {"type": "Saturated", "message": "busy"}}, 503, {"retry-after": "0"})
    server = lying(busy)
    started = time.monotonic()
    with anyio.fail_after(30):  # it stops by itself, when its budget is spent
        err = await service_error(server, retry_budget=1.0)
    assert err.status == 503 and "stayed saturated (503) for 1 s" in str(err)
    assert time.monotonic() - started >= 0.3  # it waited between tries (0.05 + 0.1 + 0.2 at the least)
    # a handful: one if a loaded machine's first try outlasted the budget
    assert 1 <= len(server.requests) <= 10, len(server.requests)


# --- case 11: a request unanswered for `timeout` seconds is a ServiceError ---------------------------------


async def _never(request: Request) -> Response:
    await asyncio.Event().wait()  # read, and never answered: cancelled when the server stops
    raise AssertionError("unreachable")


async def test_a_service_that_never_answers_is_a_service_error_at_the_timeout() -> None:
    with Server(_never) as silent:
        started = time.monotonic()
        with anyio.fail_after(30):
            err = await service_error(silent, timeout=1.0)  # a second: the request is read in full before it
        assert f"no answer came within 1 s from the scoring service at {silent.url}" in str(err), err
        assert time.monotonic() - started >= 1.0
        assert len(silent.requests) == 1  # read in full, and not asked again
        assert silent.requests[0].json()["items"] == ITEMS


def test_the_blocking_client_gives_up_at_its_timeout_too() -> None:
    with (
        Server(_never) as silent,
        engine.BlockingEngine.connect(silent.url, timeout=1.0) as eng,
        pytest.raises(ServiceError, match=r"no answer came within 1 s"),
    ):
        eng.score(ITEMS)


@pytest.mark.parametrize("timeout", [0, -1, 0.0, float("nan"), float("inf"), True, "5"])
def test_a_timeout_that_is_not_seconds_is_a_value_error(timeout: Any) -> None:
    for connect in (engine.Engine.connect, engine.BlockingEngine.connect):
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0, or None"):
            connect("http://127.0.0.1:9", timeout=timeout)


async def test_the_timeout_defaults_to_ten_minutes_and_none_waits_forever(lying: Callable[..., Server]) -> None:
    import inspect

    for connect in (engine.Engine.connect, engine.BlockingEngine.connect):
        assert inspect.signature(connect).parameters["timeout"].default == 600.0
    server = lying(Response.json(answer([1.0, 1.0, 1.0])))
    assert (await score_through(server, timeout=None)).rewards == [1.0, 1.0, 1.0]


# --- case 1: wide integers cross exactly --------------------------------------------------------------------


async def test_a_wide_integer_is_sent_and_read_exactly(lying: Callable[..., Server]) -> None:
    data = answer([1.0])
    data["usage"] = {"total_tokens": WIDE}
    data["verifiers"][0]["provenance"] = {"kind": "plugin", "seed": WIDE}
    server = lying(Response(200, json.dumps(data).encode(), {"content-type": "application/json"}))
    item = {"environment": "arith", "task": {"n": WIDE, "nested": [{"m": -WIDE}]}, "trajectory": "x"}
    result = await score_through(server, [item])
    body = server.requests[0].body
    assert f'"n":{WIDE}'.encode() in body and f'"m":-{WIDE}'.encode() in body, body  # the digits as they are
    assert json.loads(body)["items"] == [item]
    assert result.usage == {"total_tokens": WIDE} and type(result.usage["total_tokens"]) is int
    assert result.provenance(0)["seed"] == WIDE


async def test_an_item_that_is_not_json_is_still_a_type_error(lying: Callable[..., Server]) -> None:
    server = lying(Response.json(answer([1.0])))
    with pytest.raises(TypeError, match="cannot be sent to the scoring service"):
        await score_through(server, [{"environment": "arith", "task": {"s": {1, 2}}, "trajectory": ""}])
    assert server.requests == []
