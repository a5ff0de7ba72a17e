"""The adapters' ``url=`` path: each scores through a running ``engine serve`` via ``Engine.connect(url, token=...)``.

Skipped until ``Engine.connect`` (issue 14, branch i14/serve) is merged: remove the ``pytestmark`` line
then, and adjust :func:`served` to however ``engine serve`` is started there.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_support import child_env, engine_command

import engine
from engine.adapters.trl import EngineReward
from engine.adapters.verl import compute_score

pytestmark = pytest.mark.skip(reason="needs Engine.connect (issue 14)")

TOKEN = "adapter-test-token"



@pytest.fixture
def served(engine_toml: Path) -> Iterator[str]:
    """The URL of an ``engine serve`` over the test's environments, asking for ``TOKEN`` (as tests/test_serve.py
    starts one on i14/serve: ``--config``, ``--port``, ``--token-env``, ready once ``/healthz`` answers)."""
    import socket
    import urllib.request

    from polling import wait_until

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
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
