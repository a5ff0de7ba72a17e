"""The blocking facade, from plain synchronous code: one engine, one pool, reused across calls."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import add_endpoint_env, import_count, item
from polling import wait_until
from servers import Request, Server

from engine import BlockingEngine, EngineConfig, Limits, VerificationError


def reward_from_task(request: Request) -> dict[str, float]:
    return {"reward": request.json()["task"]["r"]}


def test_runs_from_sync_code_and_reuses_its_pool(envs: Path, import_log: Path) -> None:
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()  # plain sync code: no event loop here
    with Server.json(reward_from_task) as server:
        url = server.url + "/score"
        add_endpoint_env(envs, "remote", url)
        config = EngineConfig(environments=envs, allow_unpinned=True, refs={url: Limits(max_concurrency=3)})
        with BlockingEngine(config) as eng:
            first = eng.score([item("remote", r=i / 10) for i in range(9)] + [item("import_log"), item("twin_b")])
            opened = server.opened
            second = eng.score([item("twin_a")] + [item("remote", r=i / 100) for i in range(9)] + [item("import_log")])
            assert server.opened == opened  # the second call reused the kept-alive connections
        assert first == [i / 10 for i in range(9)] + [1.0, 0.75]
        assert second == [0.25] + [i / 100 for i in range(9)] + [1.0]
        assert 1 <= opened <= 3
        assert len(server.requests) == 18
        assert import_count(import_log) == 1  # imported plugins are kept between calls too
        wait_until(lambda: server.open_connections == 0)  # closed on exit


def test_failure_is_raised_in_the_caller(config: EngineConfig) -> None:
    with BlockingEngine(config) as eng:
        with pytest.raises(VerificationError) as info:
            eng.score([item("twin_a"), item("faulty", item_id="z", mode="raise")])
        assert type(info.value) is VerificationError
        assert (info.value.index, info.value.item_id, info.value.environment) == (1, "z", "faulty")
        assert eng.score([item("twin_b")]) == [0.75]  # the engine survives a failed batch


def test_misuse_is_raised_in_the_caller(config: EngineConfig) -> None:
    with BlockingEngine(config) as eng, pytest.raises(ValueError, match="unknown environment"):
        eng.score([item("nowhere")])


def test_score_outside_the_with_block_is_refused(config: EngineConfig) -> None:
    eng = BlockingEngine(config)
    with pytest.raises(RuntimeError, match="not open"):
        eng.score([item("twin_a")])
    with eng:
        assert eng.score([item("twin_a")]) == [0.25]
    with pytest.raises(RuntimeError, match="not open"):
        eng.score([item("twin_a")])


def test_from_config(tmp_path: Path, envs: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text('environments = "envs"\nallow_unpinned = true\n')
    with BlockingEngine.from_config(path) as eng:
        assert eng.config.environments == envs
        assert eng.score([item("length", "z" * 42)]) == [0.42]
