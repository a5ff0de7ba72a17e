"""Typos that once passed in silence, as each surface reports them: a manifest's unknown key (``"exmaple"``: its
example never checked; ``"verifer"``: read as no verifier) and a ``[pins]`` entry for an environment that is not
there. The Python API, ``engine check`` and ``engine score`` each refuse them, naming the file, the key and the
closest name that exists."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest
from cli_support import PLUGIN_ENV, make_workspace, rows, write_rows
from conftest import add_env, item
from test_cli import check_row, squeezed

from engine import BlockingEngine, ConfigError, Engine, EngineConfig, Limits, ManifestError, load_config
from engine._cli.lifecycle import EXIT_BAD_INPUT, EXIT_OK, EXIT_VERIFICATION
from engine._environments.digest import digest_directory

EXAMPLE = {"task": {"a": 1}, "trajectory": "2"}


def misspell(environment: Path, key: str, typo: str) -> Path:
    """Rename the manifest's top-level ``key`` (adding it with EXAMPLE if it has none) to ``typo``; the manifest."""
    path = environment / "manifest.json"
    content = orjson.loads(path.read_bytes())
    content[typo] = content.pop(key, EXAMPLE)
    path.write_bytes(orjson.dumps(content))
    return path


def refused(config: EngineConfig) -> ConfigError:
    with pytest.raises(ConfigError) as info, BlockingEngine(config):
        pass
    return info.value


# --- [pins]: the Python API ---------------------------------------------------------------------


def test_a_pin_of_no_environment_is_refused_naming_the_closest(envs: Path) -> None:
    pin = digest_directory(envs / "twin_a")
    error = refused(EngineConfig(environments=envs, pins={"twin_a": pin, "twin-a": pin}))
    assert str(error).startswith(f"pins.twin-a: names no environment under {envs} (the closest that does is 'twin_a')")
    assert "pins.twin_a" not in str(error)
    assert not isinstance(error, ManifestError)


def test_a_config_file_names_itself_and_every_such_pin_and_ref(envs: Path, tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(
        f'environments = "{envs}"\nallow_unpinned = true\n[pins]\narth = "sha256:{"0" * 64}"\n'
        f'twin_b = "{digest_directory(envs / "twin_b")}"\n[refs."twin_a/verify:scor"]\nmax_concurrency = 2\n'
    )
    error = refused(load_config(path))
    assert error.source == path
    message = str(error)
    assert message.startswith(f"{path}: pins.arth: names no environment under {envs} (the closest that does is 'arith'")
    assert "; refs.'twin_a/verify:scor': names no verifier" in message  # both kinds of name, in one error
    assert "pins.twin_b" not in message


async def test_the_async_engine_refuses_it_when_it_opens(envs: Path) -> None:
    eng = Engine(EngineConfig(environments=envs, allow_unpinned=True, pins={"twin_c": f"sha256:{'0' * 64}"}))
    with pytest.raises(ConfigError, match=re.escape("pins.twin_c: names no environment")):
        async with eng:
            pass
    with pytest.raises(RuntimeError, match="not open"):  # it did not open: nothing to score with
        await eng.score([item("twin_a")])


@pytest.mark.parametrize("name", [".", "..", "__pycache__", "twin_a/", "../envs", "", "x" * 5_000])
def test_a_pin_naming_no_environments_directory_is_refused(envs: Path, name: str) -> None:
    """Names that are a path, not a directory's name, or one the engine never takes for an environment."""
    (envs / "__pycache__").mkdir(exist_ok=True)
    error = refused(EngineConfig(environments=envs, allow_unpinned=True, pins={name: f"sha256:{'0' * 64}"}))
    assert str(error).startswith(f"pins.{name}: names no environment under {envs} (the closest that does is ")


def test_without_an_environments_directory_every_pin_names_none(tmp_path: Path) -> None:
    error = refused(EngineConfig(environments=tmp_path / "nowhere", pins={"arith": f"sha256:{'0' * 64}"}))
    assert str(error).startswith(f"pins.arith: names no environment under {tmp_path / 'nowhere'} (there is none)")


def test_pins_of_environments_that_are_there_are_used(envs: Path) -> None:
    """A pin needs only its directory: an environment whose manifest is broken may be pinned (it fails when used)."""
    add_env(envs, "broken_manifest", "plugin", "verify:score")
    (envs / "broken_manifest" / "manifest.json").write_text("{not json")
    pins = {"twin_a": digest_directory(envs / "twin_a"), "broken_manifest": digest_directory(envs / "broken_manifest")}
    with BlockingEngine(EngineConfig(environments=envs, pins=pins, refs={"twin_b/verify:score": Limits()})) as eng:
        assert eng.score([item("twin_a")]) == [0.25]


# --- a manifest's keys: the Python API ------------------------------------------------------------


def test_a_manifest_typo_fails_load_and_score_naming_the_file_and_the_key(envs: Path) -> None:
    path = misspell(envs / "twin_a", "example", "exmaple")
    with BlockingEngine(EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        for call in (lambda: eng.load("twin_a"), lambda: eng.score([item("twin_b"), item("twin_a")])):
            with pytest.raises(ManifestError) as info:
                call()
            assert (info.value.key, info.value.source) == ("exmaple", path)
            assert str(info.value).startswith(f"{path}: exmaple: unknown key, did you mean 'example'? (known: ")
        assert eng.score([item("twin_b")]) == [0.75]  # the other environments score


# --- engine check ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "typo", "closest"), [("example", "exmaple", "example"),
                                                       ("verifier", "verifer", "verifier")])
def test_check_reports_a_manifest_typo_in_its_row(tmp_path: Path, key: str, typo: str, closest: str) -> None:
    space = make_workspace(tmp_path, PLUGIN_ENV, "arith")
    path = misspell(space.envs / "arith", key, typo)
    ran = space.run("check", "--config", space.config)
    assert ran.returncode == EXIT_VERIFICATION, ran.stdout + ran.stderr
    cells = check_row(ran.stdout, "arith")
    assert squeezed(f"{path}: {typo}: unknown key, did you mean {closest!r}?") in squeezed(cells[3]), cells
    assert cells[-1] == "NO" and check_row(ran.stdout, PLUGIN_ENV)[-1] == "yes"
    assert "is missing" not in squeezed(cells[3])


def test_check_refuses_a_pin_of_no_environment(tmp_path: Path) -> None:
    space = make_workspace(tmp_path, PLUGIN_ENV, config=f'[pins]\nbackfil = "sha256:{"0" * 64}"\n')
    ran = space.run("check", "--config", space.config)
    assert ran.returncode == EXIT_BAD_INPUT, ran.stdout + ran.stderr
    said = f"{space.config}: pins.backfil: names no environment under {space.envs}"
    assert squeezed(said) in squeezed(ran.stderr)
    assert squeezed("(the closest that does is 'backfill')") in squeezed(ran.stderr)
    space.write_config(f'[pins]\nbackfill = "{digest_directory(space.envs / PLUGIN_ENV)}"\n')
    ran = space.run("check", "--config", space.config)
    assert ran.returncode == EXIT_OK, ran.stdout + ran.stderr


# --- engine score ---------------------------------------------------------------------------------


def test_score_refuses_a_manifest_typo_and_writes_nothing(tmp_path: Path) -> None:
    space = make_workspace(tmp_path, PLUGIN_ENV)
    path = misspell(space.envs / PLUGIN_ENV, "verifier", "verifer")
    output = tmp_path / "out.jsonl"
    ran = space.score(write_rows(tmp_path / "in.jsonl", rows(3)), output)
    assert ran.returncode == EXIT_BAD_INPUT, ran.stdout + ran.stderr
    assert squeezed(f"{path}: verifer: unknown key, did you mean 'verifier'?") in squeezed(ran.stderr)
    assert not output.exists()


def test_score_refuses_a_pin_of_no_environment_and_writes_nothing(tmp_path: Path) -> None:
    space = make_workspace(tmp_path, PLUGIN_ENV, config=f'[pins]\nbackfll = "sha256:{"0" * 64}"\n')
    output = tmp_path / "out.jsonl"
    ran = space.score(write_rows(tmp_path / "in.jsonl", rows(3)), output)
    assert ran.returncode == EXIT_BAD_INPUT, ran.stdout + ran.stderr
    assert squeezed(f"{space.config}: pins.backfll: names no environment under {space.envs}") in squeezed(ran.stderr)
    assert squeezed("(the closest that does is 'backfill')") in squeezed(ran.stderr)
    assert not output.exists()
