"""How the engine reaches its servers: URLs with credentials, private CAs over real TLS, proxies from the environment.

Every server is real and on 127.0.0.1: endpoints and judges (``tests/httpserver.py``), a TLS server
whose certificate a test CA made with ``trustme`` signed, and a minimal HTTP forward proxy that
counts what it forwards.
"""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
from cli_support import make_workspace, row, write_rows
from conftest import add_endpoint_env, item
from httpserver import TestServer, json_handler
from judgeserver import JudgeServer

import engine
from engine import ConfigError, EngineConfig, Limits, load_config
from engine.cli import EXIT_BAD_INPUT
from engine.endpoint import EndpointVerifier
from engine.judge import JudgeConfig

SECRET = "s3cr3t-PASS"  # the password in every URL with credentials below


def leaked(*texts: str) -> bool:
    return any(SECRET in text for text in texts)


# --- credentials in URLs ---------------------------------------------------------------------------


@pytest.fixture
def quiet_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Every record of the engine's and httpx's loggers, down to DEBUG."""
    caplog.set_level(logging.DEBUG, logger="engine")
    caplog.set_level(logging.DEBUG, logger="httpx")
    return caplog


async def test_an_endpoint_url_with_credentials_is_refused_and_never_shown(
    envs: Path, quiet_logs: pytest.LogCaptureFixture
) -> None:
    with TestServer(json_handler(lambda request: {"reward": 1.0})) as server:
        plain = f"{server.url}/score"
        add_endpoint_env(envs, "secret", plain.replace("://", f"://alice:{SECRET}@"))
        async with engine.Engine(EngineConfig(environments=envs)) as eng:
            with pytest.raises(ConfigError) as info:
                await eng.run([item("secret", item_id="a")])
        assert server.requests == []  # nothing was sent
    err = info.value
    message = str(err)
    assert "field 'verifier.ref': the URL carries credentials" in message, message
    assert f'[refs."{plain}"] headers = {{ Authorization = "Basic ${{VERIFIER_AUTH}}" }}' in message, message
    assert not leaked(message, repr(err), quiet_logs.text, *(r.getMessage() for r in quiet_logs.records))


def test_the_command_line_refuses_it_and_writes_no_reward(tmp_path: Path) -> None:
    with TestServer(json_handler(lambda request: {"reward": 1.0})) as server:
        space = make_workspace(tmp_path)
        add_endpoint_env(space.envs, "secret", f"{server.url}/score".replace("://", f"://alice:{SECRET}@"))
        out = space.root / "out.jsonl"
        result = space.score(write_rows(space.root / "in.jsonl", [row(0, "secret")]), out)
        assert server.requests == []
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert "the URL carries credentials" in result.stderr
    assert not leaked(result.stdout, result.stderr)
    written = [path.read_bytes().decode(errors="replace") for path in space.root.rglob("out*") if path.is_file()]
    assert not leaked(*written)  # no provenance (nor anything else) holds it


@pytest.mark.parametrize("userinfo", [f"alice:{SECRET}", SECRET])
def test_a_judge_base_url_with_credentials_is_refused_without_echoing_it(tmp_path: Path, userinfo: str) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(f'[judge]\nbase_url = "https://{userinfo}@judge.example/v1"\nmodel = "m"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: judge.base_url: the URL carries credentials"), message
    assert "use https://judge.example/v1 and name the variable holding the key in api_key_env" in message
    assert not leaked(message, repr(info.value))


def test_a_judge_config_built_in_code_refuses_credentials_too(quiet_logs: pytest.LogCaptureFixture) -> None:
    """httpx would have sent them, and logged the URL, password and all, at INFO with every request."""
    with JudgeServer() as judge:
        base_url = judge.base_url.replace("://", f"://alice:{SECRET}@")
        with pytest.raises(ConfigError) as info:
            JudgeConfig(base_url=base_url, model="m")
        assert judge.requests == []
    assert not leaked(str(info.value), repr(info.value), quiet_logs.text)


def test_a_refs_key_with_credentials_is_refused_without_echoing_it(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(f'[refs."http://alice:{SECRET}@127.0.0.1:8080/score"]\nmax_concurrency = 2\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: refs.'http://127.0.0.1:8080/score': the URL carries credentials"), message
    assert not leaked(message, repr(info.value))


def test_an_endpoint_verifier_built_in_code_refuses_credentials_too() -> None:
    with pytest.raises(ValueError, match="must not carry credentials") as info:
        EndpointVerifier(f"http://u:{SECRET}@127.0.0.1:1/score", Limits(), httpx.AsyncHTTPTransport())
    assert not leaked(str(info.value))

