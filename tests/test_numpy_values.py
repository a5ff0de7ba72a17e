"""numpy values in items, as trainers hand them over (verl's ``extra_info`` holds np.int64, its data sources are
``np.str_``): scored in process, sent to an endpoint and to ``engine serve``, each value kept exactly (a float32
as the float it holds, never re-rounded to its shortest text), and named in errors as Python's values."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import add_endpoint_env, add_env
from servers import Request, Server
from test_serve import start_service, stop

import engine

# what the values below hold, as Python's: float32(0.1) is 0.10000000149011612, not 0.1
EXPECTED = {"turns": 3, "weight": 0.10000000149011612, "ids": [1, 2], "flag": True, "big": 2**64 - 1}
CHECK = f"""\
EXPECTED = {EXPECTED!r}


def score(task, trajectory):
    seen = {{key: task[key] for key in EXPECTED}}
    seen["ids"] = list(seen["ids"])
    if seen != EXPECTED:
        raise ValueError(f"the task changed on its way: {{seen!r}}")
    return task["weight"]
"""


def numpy_task() -> dict[str, Any]:
    return {"prompt": "p", "turns": np.int64(3), "weight": np.float32(0.1), "ids": np.array([1, 2]),
            "flag": np.bool_(True), "big": np.uint64(2**64 - 1)}


def write_check(envs: Path) -> str:
    name = add_env(envs, "numpy_check", "plugin", "check:score")
    (envs / name / "check.py").write_text(CHECK)
    return name


def items(count: int = 3) -> list[dict[str, Any]]:
    return [{"environment": np.str_("numpy_check"), "task": numpy_task(), "trajectory": "t", "id": np.int64(n)}
            for n in range(count)]


async def test_in_process_the_plugin_gets_the_values_and_their_reward(envs: Path, config: engine.EngineConfig) -> None:
    write_check(envs)
    async with engine.Engine(config) as eng:
        rewards = await eng.score(items())
    assert rewards == [EXPECTED["weight"]] * 3 and all(type(reward) is float for reward in rewards)


async def test_an_error_names_a_numpy_environment_and_id_as_python_values(config: engine.EngineConfig) -> None:
    bad = {"environment": np.str_("faulty"), "task": {"mode": "raise"}, "trajectory": "t", "id": np.int64(7)}
    async with engine.Engine(config) as eng:
        with pytest.raises(engine.VerificationError) as caught:
            await eng.score([bad])
    error = caught.value
    assert type(error.environment) is str and type(error.item_id) is int
    assert "np." not in str(error) and "(environment 'faulty')" in str(error) and "(id 7)" in str(error)


async def test_an_endpoint_receives_each_value_exactly(envs: Path, config: engine.EngineConfig) -> None:
    seen: list[Any] = []

    def reply(request: Request) -> dict[str, float]:
        seen.append(request.json())
        return {"reward": 1.0}

    with Server.json(reply) as server:
        add_endpoint_env(envs, "numpy_endpoint", server.url)
        async with engine.Engine(config) as eng:
            batch = [{**one, "environment": np.str_("numpy_endpoint")} for one in items(2)]
            assert await eng.score(batch) == [1.0, 1.0]
    for body in seen:
        assert {key: body["task"][key] for key in EXPECTED} == EXPECTED


async def test_a_numpy_nan_is_refused_on_its_way_to_an_endpoint_not_sent_as_null(
    envs: Path, config: engine.EngineConfig
) -> None:
    with Server.json(lambda request: {"reward": 1.0}) as server:
        add_endpoint_env(envs, "numpy_endpoint", server.url)
        async with engine.Engine(config) as eng:
            bad = {"environment": "numpy_endpoint", "task": {"w": np.float32("nan")}, "trajectory": "t"}
            with pytest.raises(engine.VerificationError, match="NaN"):
                await eng.score([bad])
            assert server.requests == []


def test_engine_serve_gets_each_value_exactly_and_a_nan_is_the_callers_type_error(tmp_path: Path) -> None:
    write_check(tmp_path / "envs")
    service = start_service(tmp_path, "")
    try:
        async def both() -> tuple[list[float], BaseException | None]:
            async with engine.Engine.connect(service.url) as eng:
                rewards = await eng.score(items())
                try:
                    await eng.score([{"environment": "numpy_check", "task": {"w": np.float64("nan")},
                                      "trajectory": "t"}])
                except TypeError as exc:
                    return rewards, exc
                return rewards, None

        rewards, refused = asyncio.run(both())
    finally:
        stop(service)
    assert rewards == [EXPECTED["weight"]] * 3
    assert isinstance(refused, TypeError) and "NaN" in str(refused)


async def test_an_unknown_numpy_environment_is_named_as_a_python_string(config: engine.EngineConfig) -> None:
    async with engine.Engine(config) as eng:
        with pytest.raises(ValueError, match="unknown environment 'probe'"):
            await eng.score([{"environment": np.str_("probe"), "task": {}, "trajectory": "t"}])


def test_an_error_takes_numpy_scalars_as_python_values_by_the_json_writers_rule() -> None:
    """One rule tells numpy's values apart (``engine._numpy``): what JSON writes as Python's value, an error names
    as it; a date, whose ``tolist()`` would be another value (nanoseconds as an int), and an array stay as given."""
    from engine import _json

    named = engine.VerificationError("plugin", "verify:score", "boom", environment=np.str_("env"),
                                     item_id=np.uint64(2**64 - 1))
    assert (type(named.environment), named.environment) == (str, "env")
    assert (type(named.item_id), named.item_id) == (int, 2**64 - 1)
    assert _json.loads(_json.dumps(np.uint64(2**64 - 1), default=_json.plain)) == named.item_id
    when = np.datetime64("2024-01-02T03:04:05.000000006")
    assert engine.VerificationError("plugin", "r", "boom", item_id=when).item_id is when
    ids = np.array([1, 2])
    assert engine.VerificationError("plugin", "r", "boom", item_id=ids).item_id is ids
