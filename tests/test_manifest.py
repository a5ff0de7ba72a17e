"""Manifests and batch items: what is refused, with which error, before anything is scored."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest
from conftest import add_endpoint_env, import_count, item
from servers import Server
from special_files import SPECIAL_KINDS, make_special

import engine
from engine import ManifestError, load_environment
from engine._environments.manifest import MAX_MANIFEST_BYTES
from engine._reasons import a_or_an


def write_manifest(root: Path, content: Any, name: str = "env") -> Path:
    directory = root / name
    directory.mkdir()
    raw = content if isinstance(content, bytes) else orjson.dumps(content)
    (directory / "manifest.json").write_bytes(raw)
    return directory


def manifest(kind: Any, ref: Any, **extra: Any) -> dict[str, Any]:
    return {"kind": "environment", **extra, "verifier": {"kind": kind, "ref": ref}}


def refused(directory: Path) -> str:
    with pytest.raises(ManifestError) as info:
        load_environment(directory)
    message = str(info.value)
    assert message.startswith(str(directory / "manifest.json")), message  # names the file
    return message


@pytest.mark.parametrize(
    ("kind", "ref", "key"),
    [
        ("rubric", "alice/arithmetic-correctness", "alice/arithmetic-correctness"),
        ("rubric", "alice/arithmetic-correctness@3", "alice/arithmetic-correctness"),
        ("plugin", "verify:score", "env/verify:score"),
        ("plugin", "scoring.length:Scorer.score", "env/scoring.length:Scorer.score"),
        ("endpoint", "http://127.0.0.1:8080/score", "http://127.0.0.1:8080/score"),
        ("endpoint", "https://judge.example/v1/score?x=1", "https://judge.example/v1/score?x=1"),
    ],
)
def test_valid_manifests_of_each_kind(tmp_path: Path, kind: str, ref: str, key: str) -> None:
    directory = write_manifest(tmp_path, manifest(kind, ref, version="1.2", description="anything"))
    env = load_environment(directory)
    assert env.name == "env"
    assert env.path == directory
    assert (env.verifier.kind, env.verifier.ref) == (kind, ref)
    assert env.verifier_key == key
    assert env.manifest["version"] == "1.2"  # descriptive keys are allowed and kept


def test_invalid_json(tmp_path: Path) -> None:
    message = refused(write_manifest(tmp_path, b'{"kind": "environment",'))
    assert "invalid JSON" in message


def test_not_an_object(tmp_path: Path) -> None:
    assert "must be a JSON object, got list" in refused(write_manifest(tmp_path, [1, 2]))


def test_wrong_top_level_kind(tmp_path: Path) -> None:
    message = refused(write_manifest(tmp_path, {"kind": "dataset", "verifier": {"kind": "plugin", "ref": "a:b"}}))
    assert "field 'kind' must be 'environment'" in message


def test_missing_verifier(tmp_path: Path) -> None:
    assert "field 'verifier' is missing" in refused(write_manifest(tmp_path, {"kind": "environment"}))


def test_verifier_not_an_object(tmp_path: Path) -> None:
    message = refused(write_manifest(tmp_path, {"kind": "environment", "verifier": "verify:score"}))
    assert "field 'verifier' must be an object" in message


def unknown(directory: Path, key: str) -> str:
    """The problem a manifest with the unknown ``key`` is refused with; the error names the file and the key."""
    with pytest.raises(ManifestError) as info:
        load_environment(directory)
    path = directory / "manifest.json"
    assert (info.value.key, info.value.source) == (key, path)  # fields, for a reader that must not parse the message
    assert str(info.value) == f"{path}: {key}: {info.value.problem}"
    assert info.value.problem.startswith("unknown key")
    return info.value.problem


EXAMPLE = {"task": {"a": 1}, "trajectory": "2"}


@pytest.mark.parametrize(
    ("content", "key", "closest"),
    [
        ({**manifest("plugin", "a:b"), "exmaple": EXAMPLE}, "exmaple", "example"),  # engine check would skip it
        ({"kind": "environment", "verifer": {"kind": "plugin", "ref": "a:b"}}, "verifer", "verifier"),  # not "missing"
        ({**manifest("plugin", "a:b"), "descripton": "x"}, "descripton", "description"),
        ({**manifest("plugin", "a:b"), "Version": "1"}, "Version", "version"),
    ],
)
def test_a_typo_in_a_top_level_key_is_refused_naming_the_closest(
    tmp_path: Path, content: dict[str, Any], key: str, closest: str
) -> None:
    problem = unknown(write_manifest(tmp_path, content), key)
    assert f"did you mean {closest!r}?" in problem
    assert problem.endswith("(known: description, example, kind, verifier, version)")


@pytest.mark.parametrize("key", ["timeout_s", "", "a\nb", "\u202e", "k" * 10_000])  # far, empty, hostile, huge
def test_a_top_level_key_like_none_is_refused_naming_every_key(tmp_path: Path, key: str) -> None:
    problem = unknown(write_manifest(tmp_path, {**manifest("plugin", "a:b"), key: 1}), key)
    assert problem == "unknown key (known: description, example, kind, verifier, version)"


def test_every_key_a_manifest_takes_is_accepted(tmp_path: Path) -> None:
    content = {**manifest("plugin", "a:b"), "version": "1", "description": "d", "example": EXAMPLE}
    assert load_environment(write_manifest(tmp_path, content)).manifest["example"] == EXAMPLE


@pytest.mark.parametrize(
    ("verifier", "key", "said"),
    [
        ({"kind": "plugin", "ref": "a:b", "timeout": 3}, "verifier.timeout", "(known: executor, kind, ref, workers)"),
        ({"kind": "plugin", "ref": "a:b", "executer": "process"}, "verifier.executer", "did you mean 'executor'?"),
        ({"kind": "plugin", "ref": "a:b", "worker": 2}, "verifier.worker", "did you mean 'workers'?"),
        ({"kind": "plugin", "ref": "a:b", "rf": "c:d"}, "verifier.rf", "did you mean 'ref'?"),
        ({"kind": "endpoint", "ref": "http://h/s", "executor": "process"}, "verifier.executor",
         "(known: kind, ref); 'executor' is for plugins only"),
        ({"kind": "rubric", "ref": "a/b", "workers": 2}, "verifier.workers",
         "(known: kind, ref); 'workers' is for plugins only"),
    ],
)
def test_verifier_unknown_keys(tmp_path: Path, verifier: dict[str, Any], key: str, said: str) -> None:
    content = {"kind": "environment", "verifier": verifier}
    assert said in unknown(write_manifest(tmp_path, content), key)


@pytest.mark.parametrize("kind", ["python", "builtin", "exact_match", None])
def test_unknown_or_missing_kind(tmp_path: Path, kind: Any) -> None:
    content = manifest(kind, "verify:score")
    if kind is None:
        del content["verifier"]["kind"]
    message = refused(write_manifest(tmp_path, content))
    assert "field 'verifier.kind'" in message
    assert "exactly three kinds" in message
    assert "no built-in" in message
    assert "'rubric', 'plugin', 'endpoint'" in message


@pytest.mark.parametrize(
    ("kind", "ref"),
    [
        ("rubric", "arithmetic-correctness"),
        ("rubric", "alice/arithmetic@0"),
        ("rubric", "alice/arithmetic@latest"),
        ("rubric", "alice/sub/arithmetic"),
        ("plugin", "verify"),
        ("plugin", "my-verify:score"),
        ("plugin", "2verify:score"),
        ("plugin", "verify:"),
        ("plugin", "../evil:score"),
        ("plugin", "verify:score()"),
        ("endpoint", "127.0.0.1:8080/score"),
        ("endpoint", "ftp://judge.example/score"),
        ("endpoint", "http://"),
        ("endpoint", "http://judge example/score"),
        ("plugin", 5),
        ("rubric", None),
    ],
)
def test_bad_ref_per_kind(tmp_path: Path, kind: str, ref: Any) -> None:
    message = refused(write_manifest(tmp_path, manifest(kind, ref)))
    assert f"field 'verifier.ref' is {ref!r}" in message
    form = {
        "rubric": "'owner/name' or 'owner/name@N'",
        "plugin": "'module:callable'",
        "endpoint": "http:// or https://",
    }
    assert form[kind] in message
    article = {"rubric": "; a rubric ref", "plugin": "; a plugin ref", "endpoint": "; an endpoint ref"}
    assert f"{article[kind]} must be " in message


def test_no_manifest_file(tmp_path: Path) -> None:
    (tmp_path / "env").mkdir()
    assert "no manifest" in refused(tmp_path / "env")


def test_the_manifest_is_kept_as_read(tmp_path: Path) -> None:
    """What the digest must have hashed for a plugin to run (engine._verifiers.plugin.verifier compares the two)."""
    raw = b'{"kind": "environment",\n "verifier": {"kind": "plugin", "ref": "verify:score"}}\n'
    assert load_environment(write_manifest(tmp_path, raw)).manifest_bytes == raw


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", SPECIAL_KINDS)
def test_a_manifest_that_is_not_a_regular_file_is_refused_unread(tmp_path: Path, kind: str) -> None:
    """A FIFO would block its reader (the event loop) forever; /dev/zero would fill memory."""
    directory = tmp_path / "env"
    directory.mkdir()
    what = make_special(directory / "manifest.json", kind)
    assert f"is {what}, not a regular file" in refused(directory)


def test_a_manifest_larger_than_its_limit_is_refused(tmp_path: Path) -> None:
    body = orjson.dumps(manifest("plugin", "verify:score"))
    padded = body + b" " * (MAX_MANIFEST_BYTES - len(body))  # exactly the limit: still a manifest
    assert load_environment(write_manifest(tmp_path, padded, name="at_limit")).verifier.ref == "verify:score"
    message = refused(write_manifest(tmp_path, padded + b" ", name="past_limit"))
    assert f"larger than {MAX_MANIFEST_BYTES} bytes" in message


@pytest.mark.timeout(30)
async def test_a_fifo_manifest_in_a_batch_raises_at_once(envs: Path) -> None:
    """Not a hang of the event loop: the manifest is read on it, before any digest."""
    (envs / "piped").mkdir()
    os.mkfifo(envs / "piped" / "manifest.json")
    async with engine.Engine(engine.EngineConfig(environments=envs, allow_unpinned=True)) as eng:
        with pytest.raises(ManifestError, match="is a named pipe"):
            await eng.score([item("twin_a"), item("piped")])


# --- batch items: misuse of the API is TypeError/ValueError, raised before anything is scored ---


def no_request_handler_server() -> Server:
    return Server.json(lambda request: {"reward": 1.0})


@pytest.mark.parametrize(
    ("bad", "error", "text"),
    [
        (item("no_such_environment"), ValueError, "item 1: unknown environment 'no_such_environment'"),
        (item("no_such_environment", item_id="r-1"), ValueError, "item 1 (id 'r-1'): unknown environment"),
        (item("x" * 300), ValueError, "item 1: 'environment' must be an environment's directory name"),
        (["environment", "task"], TypeError, "item 1 is a list, not a mapping"),
        (7, TypeError, "item 1 is an int, not a mapping"),
        ({"environment": "twin_a", "task": 1, "trajectory": ""}, TypeError, "item 1: 'task' is an int, not a mapping"),
        ({"environment": "twin_a", "trajectory": ""}, ValueError, "item 1 has no 'task'"),
        ({"environment": "twin_a", "task": {}}, ValueError, "item 1 has no 'trajectory'"),
        ({"task": {}, "trajectory": ""}, ValueError, "item 1 has no 'environment'"),
        ({"environment": "../twin_a", "task": {}, "trajectory": ""}, ValueError, "item 1: 'environment'"),
        ({"environment": "twin_a", "task": "2+2", "trajectory": ""}, TypeError, "item 1: 'task' is a str"),
    ],
)
async def test_bad_item_raises_before_anything_is_scored(
    envs: Path, import_log: Path, bad: Any, error: type[Exception], text: str
) -> None:
    with no_request_handler_server() as server:
        add_endpoint_env(envs, "remote", server.url)
        config = engine.EngineConfig(environments=envs, allow_unpinned=True)
        async with engine.Engine(config) as eng:
            batch = [item("remote"), bad, item("import_log")]
            with pytest.raises(error) as info:
                await eng.score(batch)
            assert not isinstance(info.value, engine.VerificationError)
            assert text in str(info.value)
            # the valid items before and after it were not scored: no request, no import
            assert server.requests == []
            assert import_count(import_log) == 0
            # the engine is still usable afterwards
            assert await eng.score([item("remote")]) == [1.0]


async def test_bad_manifest_in_a_batch_raises_before_anything_is_scored(envs: Path) -> None:
    write_manifest(envs, b"not json", name="broken_manifest")
    with no_request_handler_server() as server:
        add_endpoint_env(envs, "remote", server.url)
        async with engine.Engine(engine.EngineConfig(environments=envs, allow_unpinned=True)) as eng:
            with pytest.raises(ManifestError, match="invalid JSON"):
                await eng.score([item("remote"), item("broken_manifest")])
        assert server.requests == []


async def test_empty_batch_and_any_iterable(config: engine.EngineConfig) -> None:
    async with engine.Engine(config) as eng:
        assert await eng.score([]) == []
        assert await eng.score(item(name) for name in ("twin_b", "twin_a")) == [0.75, 0.25]


async def test_score_on_a_closed_engine_is_refused(config: engine.EngineConfig) -> None:
    eng = engine.Engine(config)
    with pytest.raises(RuntimeError, match="not open"):
        await eng.score([item("twin_a")])


@pytest.mark.parametrize(("noun", "said"), [("endpoint", "an endpoint"), ("int", "an int"), ("list", "a list"),
                                            ("Item", "an Item"), ("float", "a float"), ("", "a ")])
def test_a_kind_or_a_type_in_a_message_takes_its_article(noun: str, said: str) -> None:
    assert a_or_an(noun) == said
