"""Configuration: the TOML file, its defaults and per-verifier overrides, and every way it can be wrong."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import item

import engine
from engine import ConfigError, EngineConfig, Limits, load_config
from engine._config import DEFAULT_MAX_CONCURRENCY, DEFAULT_MAX_IN_FLIGHT, DEFAULT_TIMEOUT

PIN = "sha256:" + "ab" * 32
ENDPOINT = "http://127.0.0.1:8080/score"

FULL = f"""
environments = "envs"
allow_unpinned = false
max_in_flight = 256
threads = 16

[pins]
arith = "{PIN}"

[defaults]
max_concurrency = 32
timeout = 30.0
max_attempts = 4
retry_deadline = 20

[refs."{ENDPOINT}"]
max_concurrency = 8
max_rate = 50.0

[refs."arith/verify:score"]
timeout = 5

[refs."alice/arithmetic-correctness"]
max_concurrency = 2
max_rate = 5.0
"""


def write(tmp_path: Path, text: str, name: str = "engine.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_full_file_parses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "conf").mkdir()
    path = write(tmp_path / "conf", FULL)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the environments path is relative to the file, not to the cwd

    config = load_config(path)

    assert config.environments == tmp_path / "conf" / "envs"
    assert config.allow_unpinned is False
    assert config.max_in_flight == 256
    assert config.threads == 16
    assert dict(config.pins) == {"arith": PIN}
    assert config.source == path
    assert config.defaults == Limits(max_concurrency=32, timeout=30.0, max_attempts=4, retry_deadline=20.0)


def test_per_ref_overrides_merge_over_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FULL))

    # only the keys a [refs."..."] table names change; the rest come from [defaults], not from the built-ins
    assert config.limits_for(ENDPOINT) == Limits(
        max_concurrency=8, max_rate=50.0, timeout=30.0, max_attempts=4, retry_deadline=20.0
    )
    assert config.limits_for("arith/verify:score") == Limits(
        max_concurrency=32, timeout=5.0, max_attempts=4, retry_deadline=20.0
    )
    assert config.limits_for("alice/arithmetic-correctness") == Limits(
        max_concurrency=2, max_rate=5.0, timeout=30.0, max_attempts=4, retry_deadline=20.0
    )
    assert config.limits_for("someone/else") == config.defaults


def test_empty_file_gives_the_documented_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, ""))
    assert config.environments == tmp_path / "envs"
    assert config.allow_unpinned is False
    assert config.max_in_flight == DEFAULT_MAX_IN_FLIGHT
    assert config.defaults == Limits()
    assert config.defaults.max_concurrency == DEFAULT_MAX_CONCURRENCY
    assert config.defaults.timeout == DEFAULT_TIMEOUT
    assert config.defaults.max_rate is None


async def test_engine_from_config_scores_with_it(tmp_path: Path, envs: Path) -> None:
    path = write(tmp_path, 'environments = "envs"\nallow_unpinned = true\n')
    async with engine.Engine.from_config(path) as eng:
        assert eng.config.environments == envs
        rewards = await eng.score([item("twin_a"), item("twin_b")])
    assert rewards == [0.25, 0.75]


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("max_inflight = 4", "max_inflight"),
        ("[defaults]\nmax_concurrency = 0", "defaults.max_concurrency"),
        ("[defaults]\nmax_concurrency = 2.5", "defaults.max_concurrency"),
        ("[defaults]\nmax_concurrency = true", "defaults.max_concurrency"),
        ("[defaults]\nconcurrency = 4", "defaults.concurrency"),
        ("[defaults]\ntimeout = inf", "defaults.timeout"),
        ("[defaults]\ntimeout = nan", "defaults.timeout"),
        ("[defaults]\ntimeout = 0", "defaults.timeout"),
        ("[defaults]\nmax_attempts = 0", "defaults.max_attempts"),
        ("[defaults]\nretry_deadline = -1", "defaults.retry_deadline"),
        ('[refs."x/y"]\nmax_rate = -1', "refs.'x/y'.max_rate"),
        ('[refs."x/y"]\nmax_rate = "fast"', "refs.'x/y'.max_rate"),
        ('[refs."x/y"]\nspeed = 1', "refs.'x/y'.speed"),
        ('[refs]\n"x/y" = 5', "refs.'x/y'"),
        ("refs = 5", "refs"),
        ("defaults = 5", "defaults"),
        ('[pins]\narith = "abc"', "pins.arith"),
        ('[pins]\narith = "sha256:' + "AB" * 32 + '"', "pins.arith"),
        ("[pins]\narith = 5", "pins.arith"),
        ("pins = 5", "pins"),
        ("max_in_flight = 0", "max_in_flight"),
        ("threads = -2", "threads"),
        ('allow_unpinned = "yes"', "allow_unpinned"),
        ("environments = 5", "environments"),
        ('environments = ""', "environments"),
    ],
)
def test_bad_key_or_value_names_the_key_and_the_file(tmp_path: Path, text: str, key: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {key}"), message
    assert isinstance(info.value, ValueError)
    assert (info.value.key, info.value.source) == (key, path)  # fields, for a reader that must not parse the message
    assert message == f"{path}: {key}: {info.value.problem}"


JUDGE = '[judge]\nbase_url = "http://127.0.0.1:1/v1"\nmodel = "m"\n'


@pytest.mark.parametrize(
    ("text", "key", "closest"),
    [
        ("max_inflight = 4", "max_inflight", "max_in_flight"),
        ("thread = 4", "thread", "threads"),
        ('enviroments = "envs"', "enviroments", "environments"),
        ("allow_unpined = true", "allow_unpined", "allow_unpinned"),
        ('[pin]\narith = "x"', "pin", "pins"),
        ("[defaults]\nmax_concurency = 2", "defaults.max_concurency", "max_concurrency"),
        ('[refs."x/y"]\ntimeot = 1', "refs.'x/y'.timeot", "timeout"),
        (JUDGE + 'modle = "m2"', "judge.modle", "model"),
        (JUDGE + "max_token = 9", "judge.max_token", "max_tokens"),
    ],
)
def test_an_unknown_key_names_the_closest_known_one(tmp_path: Path, text: str, key: str, closest: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert (info.value.key, info.value.source) == (key, path)
    assert info.value.problem.startswith(f"unknown key, did you mean {closest!r}? (known: "), info.value


@pytest.mark.parametrize(("text", "table"), [("zzz = 1", None), ("[defaults]\nzzz = 1", "defaults")])
def test_an_unknown_key_like_none_names_every_known_one(tmp_path: Path, text: str, table: str | None) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert info.value.field == "zzz" and info.value.table == table
    known = info.value.problem.removeprefix("unknown key (known: ").removesuffix(")").split(", ")
    assert "did you mean" not in info.value.problem
    assert ("max_in_flight" if table is None else "max_concurrency") in known and known == sorted(known)


def test_invalid_toml_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, "max_in_flight = = 4\n")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert info.value.__cause__ is not None


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(ConfigError, match=r"Limits\.max_concurrency: must be a whole number >= 1, got 0") as info:
        Limits(max_concurrency=0)
    assert (info.value.key, info.value.field, info.value.source) == ("Limits.max_concurrency", "max_concurrency", None)
    with pytest.raises(ConfigError, match=r"Limits\.max_rate"):
        Limits(max_rate=math.nan)
    with pytest.raises(ConfigError, match=r"refs\.'x/y': must be a Limits"):
        EngineConfig(refs={"x/y": {"timeout": 1}})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match=r"pins\.arith"):
        EngineConfig(pins={"arith": "md5:00"})
    with pytest.raises(ConfigError, match="allow_unpinned"):
        EngineConfig(allow_unpinned=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="defaults: must be a Limits, got dict"):
        EngineConfig(defaults={"timeout": 1})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="pins: must be a mapping"):
        EngineConfig(pins=[("arith", PIN)])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="refs: must be a mapping"):
        EngineConfig(refs=[Limits()])  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["timeout", "max_attempts", "retry_deadline"])
def test_a_rubric_refs_table_refuses_the_judges_call_settings(tmp_path: Path, key: str) -> None:
    # a rubric's calls are the judge's, whose budget is set under [judge]: refusing beats ignoring
    path = write(tmp_path, f'[refs."alice/arithmetic-correctness"]\n{key} = 3\n')
    with pytest.raises(ConfigError, match=rf"refs.'alice/arithmetic-correctness'.{key}: .*under \[judge\]"):
        load_config(path)


def test_config_is_frozen_and_its_tables_read_only() -> None:
    pins = {"arith": PIN}
    config = EngineConfig(pins=pins, refs={"a/b": Limits(max_concurrency=1)})
    pins["arith"] = "tampered"  # the config took a copy
    assert config.pins["arith"] == PIN
    with pytest.raises(TypeError):
        config.pins["other"] = PIN  # type: ignore[index]
    with pytest.raises(TypeError):
        config.refs["a/b"] = Limits()  # type: ignore[index]
    with pytest.raises(AttributeError):
        config.max_in_flight = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("table", "key", "said"),
    [
        ("[defaults]\nmax_abandoned = -1", "defaults.max_abandoned", "must be a whole number >= 0, got -1"),
        ('[refs."http://127.0.0.1:8080/score"]\nheaders = { "Bad Name" = "${X}" }',
         "refs.'http://127.0.0.1:8080/score'.headers.Bad Name", "is not a valid HTTP header name"),
        ('[judge]\nbase_url = "http://127.0.0.1:1/v1"\nmodel = "m"\ntemperature = -1', "judge.temperature",
         "must be a number >= 0, got -1"),
        ('[judge]\nbase_url = "http://127.0.0.1:1/v1"\nmodel = "m"\nmax_rate = inf', "judge.max_rate",
         "must be a number > 0, got inf"),
        ('[judge]\nbase_url = "http://127.0.0.1:1/v1"\nmodel = "m"\nmax_tokens = 2.0', "judge.max_tokens",
         "must be a whole number >= 1, got 2.0"),
    ],
)
def test_a_tables_bad_value_is_re_raised_with_its_key_as_a_field(
    tmp_path: Path, table: str, key: str, said: str
) -> None:
    """A table's values are checked as the object's (``Limits``, ``JudgeConfig``): the error is raised again with
    the key it has in the file as a field, its message built from the fields, never edited."""
    path = write(tmp_path, table)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert (info.value.key, info.value.source, info.value.problem) == (key, path, said)
    assert str(info.value) == f"{path}: {key}: {said}"


@pytest.mark.parametrize(
    ("settings", "key", "said"),
    [
        ({"port": 70000}, "port", "must be a whole number from 0 to 65535, got 70000"),
        ({"max_items": 0}, "max_items", "must be a whole number >= 1, got 0"),
        ({"max_items": 10, "max_queued": 5}, "max_items", "must not exceed max_queued (5), got 10"),
        ({"graceful_timeout": -1.0}, "graceful_timeout", "must be a number >= 0, got -1.0"),
        ({"head_timeout": float("nan")}, "head_timeout", "must be a number > 0, got nan"),
        ({"keep_alive": True}, "keep_alive", "must be a whole number >= 1, got True"),
        ({"max_connections": 0}, "max_connections", "must be a whole number >= 1, got 0"),
        ({"host": "0.0.0.0"}, "host", "refusing to serve on 0.0.0.0, which is not a loopback address"),
        ({"token": "two words"}, "token", "the token holds"),
    ],
)
def test_the_services_settings_are_config_errors_naming_their_key(settings: dict[str, object], key: str,
                                                                   said: str) -> None:
    from engine._serve.limits import ServeConfig

    with pytest.raises(ConfigError) as info:
        ServeConfig(**settings)  # type: ignore[arg-type]
    assert info.value.key == key and info.value.problem.startswith(said), info.value
    assert isinstance(info.value, ValueError)  # what the CLI reports as bad input
