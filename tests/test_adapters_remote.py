"""The adapters' ``url=`` path: each scores through a running ``engine serve`` via ``Engine.connect(url, token=...)``.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_support import child_env, engine_command
from test_serve import servable

import engine
from engine.adapters.trl import EngineReward
from engine.adapters.verl import compute_score

TOKEN = "adapter-test-token"



@pytest.fixture
def served(envs: Path, engine_toml: Path) -> Iterator[str]:
    """The URL of an ``engine serve`` over the test's environments (those it starts with), asking for ``TOKEN`` (as
    tests/test_serve.py starts one: ``--config``, ``--port``, ``--token-env``, ready once ``/healthz`` answers)."""
    import socket
    import urllib.request

    from polling import wait_until

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    servable(envs)
    command = engine_command("serve", "--config", engine_toml, "--port", str(port), "--token-env", "SERVE_TOKEN")
    server = subprocess.Popen(command, cwd=engine_toml.parent, env=child_env({"SERVE_TOKEN": TOKEN}))
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            request = urllib.request.Request(f"{url}/healthz", headers={"Authorization": f"Bearer {TOKEN}"})
            with urllib.request.urlopen(request, timeout=5) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    try:
        wait_until(healthy, timeout=30)
        yield url
    finally:
        server.terminate()
        server.wait(30)


def test_trl_scores_through_the_server(served: str) -> None:
    reward = EngineReward(url=served, token=TOKEN, environment="arith")
    assert reward(prompts=["a", "b"], completions=["4", "5"], reference=["4", "4"]) == [1.0, 0.0]
    with pytest.raises(engine.VerificationError):
        EngineReward(url=served, token=TOKEN, environment="faulty")(prompts=["a"], completions=["x"], mode=["raise"])


def test_verl_gathers_per_sample_calls_through_the_server(served: str) -> None:
    async def step() -> list[float]:
        calls = [compute_score("arith", str(n), "3", url=served, token=TOKEN) for n in range(256)]
        return await asyncio.gather(*calls)

    assert asyncio.run(step()) == [1.0 if n == 3 else 0.0 for n in range(256)]


def test_the_environment_variables_name_the_server(served: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_URL", served)
    monkeypatch.setenv("ENGINE_TOKEN", TOKEN)
    assert EngineReward(environment="twin_a")(prompts=["p"], completions=["c"]) == [0.25]


def test_trl_logs_the_remote_engines_stats(served: str) -> None:
    logged: dict[str, float] = {}
    reward = EngineReward(url=served, token=TOKEN, environment="arith")
    completions, reference = ["4", "5", "4"], ["4", "4", "4"]
    reward(prompts=["a", "b", "c"], completions=completions, reference=reference, log_metric=logged.__setitem__)
    assert logged["engine/arith/verify:score/reward_mean"] == pytest.approx(2 / 3)
    assert not any(key.endswith("/items") for key in logged)  # a count, which TRL would average over ranks


def test_a_remote_engine_counts_its_batches_and_their_errors(served: str) -> None:
    with engine.BlockingEngine.connect(served, token=TOKEN) as eng:
        assert eng.score([{"environment": "arith", "task": {"prompt": "p", "reference": "4"}, "trajectory": "4"}])
        with pytest.raises(engine.VerificationError):
            eng.score([{"environment": "faulty", "task": {"prompt": "p", "mode": "raise"}, "trajectory": "x"}])
        stats = eng.stats()
    assert stats["engine/arith/verify:score/items"] == 1
    errors = [value for key, value in stats.items() if key.startswith("engine/faulty/") and key.endswith("/errors")]
    assert errors == [1]
