"""``[refs."<key>"]``: a key that names no verifier of any environment is a ``ConfigError`` when the engine opens,
naming the key and the closest key that does; a typo never leaves a verifier at the defaults in silence."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from cli_support import make_workspace
from conftest import add_endpoint_env, add_env, add_rubric_env, item

from engine import BlockingEngine, ConfigError, Engine, EngineConfig, Limits, load_config

URL = "http://127.0.0.1:9/score"  # never called: the engine only opens
RUBRIC = "alice/arithmetic-correctness"
HINT = "a key is an endpoint's URL, a rubric's owner/name or a plugin's <environment>/<module>:<callable>"


@pytest.fixture
def envs(envs: Path) -> Path:
    """tests/envs (plugins: twin_a/verify:score, arith/verify:score, ...), an endpoint and a rubric."""
    add_endpoint_env(envs, "remote", URL)
    add_rubric_env(envs, "graded", f"{RUBRIC}@2")
    return envs


def refused(config: EngineConfig) -> str:
    with pytest.raises(ConfigError) as info, BlockingEngine(config):
        pass
    return str(info.value)


@pytest.mark.parametrize(
    ("key", "closest"),
    [
        ("twin_a/verify:scor", "twin_a/verify:score"),  # a typo in the callable
        ("twin-a/verify:score", "twin_a/verify:score"),  # a typo in the environment
        (URL + "/", URL),  # a trailing '/' on the endpoint's URL
        ("http://127.0.0.1:9/Score", URL),
        ("alice/arithmetic-corectness", RUBRIC),  # a typo in the rubric
    ],
)
def test_a_key_that_names_no_verifier_is_refused_naming_the_closest(envs: Path, key: str, closest: str) -> None:
    config = EngineConfig(environments=envs, allow_unpinned=True, refs={key: Limits(max_concurrency=2)})
    message = refused(config)
    assert message.startswith(f"refs.{key!r}: names no verifier of an environment under {envs} "), message
    assert f"(the closest that does is {closest!r})" in message
    assert message.endswith(HINT)


def test_a_rubric_key_with_a_version_is_refused_saying_to_drop_it(envs: Path) -> None:
    """A rubric's limits hold for every version of it: ``owner/name@N`` is refused, and told so."""
    key = f"{RUBRIC}@2"
    message = refused(EngineConfig(environments=envs, allow_unpinned=True, refs={key: Limits(max_concurrency=2)}))
    assert message.startswith(f"refs.{key!r}: names no verifier of an environment under {envs} "), message
    assert f"(a rubric's limits are keyed without its version, for every version: {RUBRIC!r})" in message
    assert message.endswith(HINT)


async def test_the_async_engine_refuses_it_when_it_opens(envs: Path) -> None:
    config = EngineConfig(environments=envs, allow_unpinned=True, refs={"twin_a/verify:scor": Limits()})
    eng = Engine(config)
    with pytest.raises(ConfigError, match=re.escape("refs.'twin_a/verify:scor'")):
        async with eng:
            pass
    with pytest.raises(RuntimeError, match="not open"):  # it did not open: nothing to close, nothing to score with
        await eng.score([item("twin_a")])


def test_keys_that_name_verifiers_are_accepted_and_used(envs: Path) -> None:
    refs = {
        "twin_a/verify:score": Limits(max_concurrency=2),
        URL: Limits(max_concurrency=3),
        RUBRIC: Limits(max_concurrency=4),
    }
    config = EngineConfig(environments=envs, allow_unpinned=True, refs=refs)
    with BlockingEngine(config) as eng:
        assert eng.score([item("twin_a"), item("twin_a")]) == [0.25, 0.25]
        assert eng._engine._verifier("twin_a").limits.max_concurrency == 2


def test_every_key_that_names_no_verifier_is_named_and_a_file_names_itself(envs: Path, tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(
        f'environments = "{envs}"\nallow_unpinned = true\n'
        '[refs."twin_a/verify:score"]\nmax_concurrency = 2\n'
        '[refs."twin_b/verify:scor"]\nmax_concurrency = 2\n'
        f'[refs."{URL}/"]\nmax_concurrency = 2\n'
    )
    message = refused(load_config(path))
    assert message.startswith(f"{path}: refs.'twin_b/verify:scor': ")
    assert "(the closest that does is 'twin_b/verify:score')" in message
    assert f"; refs.'{URL}/': names no verifier" in message
    assert "refs.'twin_a/verify:score'" not in message


def test_without_an_environments_directory_every_key_is_unknown(tmp_path: Path) -> None:
    config = EngineConfig(environments=tmp_path / "nowhere", refs={URL: Limits()})
    assert "names no verifier of an environment under" in refused(config)
    assert "(there is none)" in refused(config)
    with BlockingEngine(EngineConfig(environments=tmp_path / "nowhere")):  # no refs: nothing to check
        pass


def test_a_broken_manifest_does_not_stop_the_others(envs: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A manifest that cannot be read fails its own environment when used, as it always did; the engine
    opens for the others. A plugin key naming that environment cannot be checked: a warning, not an error.
    Any other key that matches nothing is still refused, and the message names the unreadable manifest."""
    add_env(envs, "broken_manifest", "plugin", "verify:score")
    (envs / "broken_manifest" / "manifest.json").write_text("{not json")
    refs = {"twin_a/verify:score": Limits(max_concurrency=2), "broken_manifest/verify:score": Limits()}
    config = EngineConfig(environments=envs, allow_unpinned=True, refs=refs)
    with caplog.at_level(logging.WARNING, logger="engine"), BlockingEngine(config) as eng:
        assert eng.score([item("twin_a")]) == [0.25]
    assert "'broken_manifest/verify:score': environment 'broken_manifest' has a manifest that cannot be read" in (
        caplog.text
    )
    message = refused(EngineConfig(environments=envs, allow_unpinned=True, refs={URL + "/": Limits()}))
    assert "the manifests of 'broken_manifest' cannot be read, it may be one of theirs" in message


def test_engine_check_reports_it(tmp_path: Path) -> None:
    space = make_workspace(tmp_path, "backfill", config='[refs."backfill/verify:scor"]\nmax_concurrency = 2\n')
    ran = space.run("check", "--config", space.config)
    assert ran.returncode == 2
    assert "refs.'backfill/verify:scor': names no verifier" in ran.stderr
    assert "(the closest that does is 'backfill/verify:score')" in ran.stderr
    space.write_config('[refs."backfill/verify:score"]\nmax_concurrency = 2\n')
    ran = space.run("check", "--config", space.config)
    assert ran.returncode == 0, ran.stderr
