"""The adapters' gathering of concurrent calls (``engine.adapters._runtime.Coalescer``): each call, one sample
or a group, gets exactly what it would get alone, whatever the calls gathered beside it do."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from conftest import add_endpoint_env
from polling import started
from servers import Request, Response, Server

import engine
from engine.adapters._runtime import coalescer, source_of


def group(environment: str, trajectories: list[str], mode: str = "ok") -> list[dict[str, Any]]:
    return [{"environment": environment, "task": {"prompt": "p", "reference": "1", "mode": mode}, "trajectory": t}
            for t in trajectories]


async def gathered(config: Path, calls: list[list[dict[str, Any]]]) -> tuple[list[Any], int]:
    gather = coalescer(source_of(str(config), None, None))
    outcomes = await asyncio.gather(*(gather.score_many(call) for call in calls), return_exceptions=True)
    return outcomes, gather.batches


def test_a_failing_sample_of_a_group_names_its_place_in_its_own_group(engine_toml: Path) -> None:
    bad = group("faulty", ["a", "b"]) + group("faulty", ["c"], mode="raise")
    calls = [group("arith", ["1", "0", "1"]), bad, group("arith", ["0", "1"])]
    outcomes, batches = asyncio.run(gathered(engine_toml, calls))
    assert outcomes[0] == [1.0, 0.0, 1.0] and outcomes[2] == [0.0, 1.0]
    error = outcomes[1]
    assert isinstance(error, engine.VerificationError)
    assert (error.environment, error.index) == ("faulty", 2)  # the group's third sample, not the batch's item 5
    assert any("3 calls were gathered into one engine batch" in note and "own sample 2" in note
               for note in error.__notes__)
    assert batches == 4  # the gathered batch, then each call alone (a plugin's failure is checked alone too)


def test_a_call_alone_gets_the_error_as_the_engine_raised_it(engine_toml: Path) -> None:
    outcomes, batches = asyncio.run(gathered(engine_toml, [group("faulty", ["a", "b"], mode="raise")]))
    error = outcomes[0]
    assert isinstance(error, engine.VerificationError) and error.index in (0, 1)
    assert not getattr(error, "__notes__", None)  # nothing was gathered with it
    assert batches == 1


def test_every_failing_call_gets_its_own_error_and_the_rest_their_rewards(engine_toml: Path) -> None:
    calls = [group("faulty", ["x"], mode="raise") if n % 3 == 0 else group("arith", [str(n % 2)]) for n in range(12)]
    outcomes, _ = asyncio.run(gathered(engine_toml, calls))
    for n, outcome in enumerate(outcomes):
        if n % 3 == 0:
            assert isinstance(outcome, engine.VerificationError) and outcome.index == 0, (n, outcome)
        else:
            assert outcome == [float(n % 2)], (n, outcome)
    assert len({id(outcome) for n, outcome in enumerate(outcomes) if n % 3 == 0}) == 4  # no error shared


def test_an_empty_group_is_no_items_and_joins_no_batch(engine_toml: Path) -> None:
    outcomes, batches = asyncio.run(gathered(engine_toml, [[], group("arith", ["1"])]))
    assert outcomes == [[], [1.0]] and batches == 1


def test_an_endpoints_failure_goes_to_its_own_call_and_only_the_others_are_scored_again(
    envs: Path, engine_toml: Path
) -> None:
    """An endpoint's error is its own request's: the failing call gets it at once (not re-sent), the others alone."""
    def reply(request: Request) -> dict[str, Any]:
        trajectory = request.json()["trajectory"]
        return {"reward": "not a number"} if trajectory == "bad" else {"reward": float(len(trajectory))}

    with Server.json(reply) as server:
        add_endpoint_env(envs, "remote", server.url)
        calls = [[{"environment": "remote", "task": {"prompt": "p"}, "trajectory": t}] for t in ("a", "bad", "ccc")]
        outcomes, batches = asyncio.run(gathered(engine_toml, calls))
        bad_requests = [r for r in server.requests if r.json()["trajectory"] == "bad"]
    assert outcomes[0] == [1.0] and outcomes[2] == [3.0]
    assert isinstance(outcomes[1], engine.VerificationError) and outcomes[1].index == 0
    assert any("own sample 0" in note for note in outcomes[1].__notes__)
    assert len(bad_requests) == 1 and batches == 3


def test_a_callers_list_changed_while_it_waits_changes_nothing(engine_toml: Path) -> None:
    async def main() -> tuple[list[float], list[float]]:
        gather = coalescer(source_of(str(engine_toml), None, None))
        mine = group("arith", ["1", "0"])
        (first,) = await started(gather.score_many(mine))
        mine.append(group("arith", ["1"])[0])  # after submitting: its call is the two items it gave
        return await first, await gather.score_many(group("arith", ["0"]))

    assert asyncio.run(main()) == ([1.0, 0.0], [0.0])


def test_a_batch_never_holds_more_than_the_largest(engine_toml: Path) -> None:
    from engine.adapters._runtime import DEFAULT_MAX_BATCH

    big = DEFAULT_MAX_BATCH // 2 + 1
    calls = [group("arith", ["1"] * big), group("arith", ["0"] * big)]
    outcomes, batches = asyncio.run(gathered(engine_toml, calls))
    assert outcomes == [[1.0] * big, [0.0] * big] and batches == 2


def test_a_service_error_naming_no_usable_item_leaves_no_caller_waiting() -> None:
    """A faulty service's error whose index is not an integer: every call gets an error, none waits for ever."""
    def handler(request: Request) -> Response:
        error = {"type": "VerificationError", "kind": "plugin", "ref": "x", "environment": "arith", "index": "1",
                 "item_id": None, "message": "boom"}
        return Response.json({"error": error}, status=422)

    async def main(url: str) -> list[Any]:
        gather = coalescer(source_of(None, url, None))
        calls = [gather.score_many(group("arith", ["1"])), gather.score_many(group("arith", ["0"]))]
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)

    with Server(handler) as server:
        outcomes = asyncio.run(main(server.url))
    assert all(isinstance(outcome, engine.EngineError) for outcome in outcomes), outcomes
