"""The reference pages hold to the code, so they cannot drift from it.

docs/reference/config.md lists exactly the keys each table of engine.toml takes, each with the default its config
class has; docs/reference/manifest.md exactly the keys a manifest and its verifier object take. What a table
takes is found by asking the loader: each candidate key (the class's fields, the page's rows) is given a valid,
non-default value and loaded, and a ``ConfigError`` means the table refuses it.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import certifi
import orjson
import pytest
from test_docs_pages import blocks

from engine._config import (
    _CACHE,
    _JUDGE,
    _LIMITS,
    _TOP_LEVEL,
    COUNT,
    CacheConfig,
    EngineConfig,
    JudgeConfig,
    Limits,
    Number,
    config_from_mapping,
)
from engine._environments.manifest import (
    _PLUGIN_KEYS,
    KINDS,
    MANIFEST_KEYS,
    VerifierSpec,
    load_environment,
    parse_verifier,
)
from engine._errors import ConfigError, ManifestError

DOCS = Path(__file__).resolve().parent.parent / "docs" / "reference"
CONFIG_PAGE = DOCS / "config.md"
MANIFEST_PAGE = DOCS / "manifest.md"

REQUIRED = "required"  # a default cell's words for a key with no default
EACH = "each key's default"  # a table's: every key of it at its own default

# a valid value for each key, other than its default (a value equal to the default may pass where the key does not)
LIMIT_SAMPLES: dict[str, Any] = {
    "max_concurrency": 3, "max_rate": 2.5, "timeout": 7.0, "max_attempts": 2, "retry_deadline": 9.0,
    "max_body": 4096, "max_abandoned": 1, "headers": {"X-Token": "${TOKEN}"}, "token_budget": 5, "spend_budget": 0.5,
}
JUDGE_BASE = {"base_url": "http://127.0.0.1:9/v1", "model": "judge"}
JUDGE_SAMPLES: dict[str, Any] = {
    "base_url": "http://127.0.0.1:10/v1", "model": "other", "api_key_env": "JUDGE_KEY", "max_concurrency": 3,
    "max_rate": 2.5, "temperature": 0.5, "max_tokens": 64, "timeout": 7.0, "max_attempts": 2, "retry_deadline": 9.0,
    "max_body": 4096, "response_format": False, "headers": {"X-Team": "${TEAM}"}, "source": "engine.toml",
    "token_budget": 5, "spend_budget": 0.5, "price_per_million_input": 0.25, "price_per_million_output": 1.25,
    "dedupe": False,
}
# what a judge's key needs beside it to be valid: a spend budget the prices, a price the other
JUDGE_PRICES = {"price_per_million_input": 0.25, "price_per_million_output": 1.25}
JUDGE_NEEDS: dict[str, dict[str, Any]] = {
    "spend_budget": JUDGE_PRICES, "price_per_million_input": JUDGE_PRICES, "price_per_million_output": JUDGE_PRICES,
}
# what a refs table's key needs elsewhere in the file: a spend budget, the judge's prices
REFS_NEEDS: dict[str, dict[str, Any]] = {"spend_budget": {"judge": {**JUDGE_BASE, **JUDGE_PRICES}}}
CACHE_BASE = {"path": "verdicts.sqlite"}
CACHE_SAMPLES: dict[str, Any] = {"path": "elsewhere.sqlite", "max_entries": 10, "busy_timeout": 0.5,
                                 "source": "engine.toml"}
TOP_SAMPLES: dict[str, Any] = {
    "environments": "elsewhere", "rubrics": "graded", "allow_unpinned": True, "max_in_flight": 8, "threads": 8,
    "ca_bundle": certifi.where(), "pins": {"exact": "sha256:" + "0" * 64}, "defaults": {"timeout": 7.0},
    "refs": {"exact/verify:score": {"timeout": 7.0}}, "judge": JUDGE_BASE, "source": "engine.toml",
    "input": {"columns": {"environment": "data_source"}}, "input_columns": {"environment": "data_source"},
    "cache": CACHE_BASE,
}
# each kind's refs key, as the page's complete example names them
REF_KEYS = {"plugin": "exact/verify:score", "endpoint": "http://127.0.0.1:18731/score", "rubric": "acme/helpfulness"}
REFS = {"plugin": "verify:score", "endpoint": "http://127.0.0.1:18731/score", "rubric": "acme/helpfulness"}


def sections(page: Path) -> dict[str, str]:
    """The page's ``## `` sections by their heading (backticks dropped), each its text."""
    parts = re.split(r"^## (.+)$", page.read_text(), flags=re.M)
    return {heading.replace("`", "").strip(): body for heading, body in zip(parts[1::2], parts[2::2], strict=True)}


def tables(text: str) -> list[list[dict[str, str]]]:
    """Each Markdown table in ``text``: a row is a mapping of its column's header to its cell."""
    found: list[list[dict[str, str]]] = []
    lines = text.splitlines()
    for at, line in enumerate(lines):
        if not line.startswith("|") or (at and lines[at - 1].startswith("|")):
            continue  # only a table's first line (its header) starts one
        rows = []
        for row in lines[at:]:
            if not row.startswith("|"):
                break
            rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip())[1:-1]])
        header, _rule, *body = rows
        found.append([dict(zip(header, cells, strict=True)) for cells in body])
    return found


def key_of(cell: str) -> str:
    return cell.strip().strip("`")


def keys(table: list[dict[str, str]]) -> list[str]:
    return [key_of(row["key"]) for row in table]


def stated_default(cell: str) -> Any:
    """What a default cell says: a TOML literal in backticks, or its words (none, empty, required, each)."""
    literal = re.match(r"`([^`]+)`", cell)
    if literal:
        return tomllib.loads(f"value = {literal[1]}")["value"]
    for words, value in (("none", None), ("empty", {}), (REQUIRED, REQUIRED), (EACH, EACH)):
        if cell.startswith(words):
            return value
    raise AssertionError(f"a default cell says neither a value nor none/empty/required: {cell!r}")


FIELD_OF = {"input": "input_columns"}  # a TOML key whose class field is named otherwise


def class_default(cls: type, name: str) -> Any:
    field = {f.name: f for f in dataclasses.fields(cls)}[FIELD_OF.get(name, name)]
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return REQUIRED


def same_default(stated: Any, actual: Any) -> bool:
    if stated == EACH:
        return dataclasses.is_dataclass(actual) and actual == type(actual)()
    if isinstance(actual, Path):
        return isinstance(stated, str) and Path(stated) == actual
    if isinstance(actual, bool) or isinstance(stated, bool):
        return type(actual) is type(stated) and actual == stated
    return bool(stated == actual)


def loads(data: Mapping[str, Any]) -> bool:
    """Whether engine.toml's tables as ``data`` load (a ``ConfigError`` is a refusal)."""
    try:
        config_from_mapping(data, base_dir=Path("."))
    except ConfigError:
        return False
    return True


def sample(samples: Mapping[str, Any], cls: type, key: str, known: Collection[str] = ()) -> Any:
    """A valid value of ``key``; a key the code knows (a field of ``cls``, or in ``known``) must have one here."""
    fields = {f.name for f in dataclasses.fields(cls)} | set(known)
    assert key in samples or key not in fields, f"{cls.__name__}: {key!r} is new: give it a sample here, then a row"
    return samples.get(key, 1)  # a key the code has not: refused as unknown, whatever its value


def candidates(cls: type, page: list[str], samples: Mapping[str, Any], known: Collection[str] = ()) -> set[str]:
    """Every key a table may take: the class's fields, the key set its loader accepts, the page's, the samples'."""
    return {f.name for f in dataclasses.fields(cls)} | set(known) | set(page) | set(samples)


def config_tables() -> dict[str, list[list[dict[str, str]]]]:
    return {heading: tables(body) for heading, body in sections(CONFIG_PAGE).items()}


def check_defaults(table: list[dict[str, str]], cls: type) -> None:
    wrong = [
        (key_of(row["key"]), row["default"], class_default(cls, key_of(row["key"])))
        for row in table
        if not same_default(stated_default(row["default"]), class_default(cls, key_of(row["key"])))
    ]
    assert wrong == [], f"defaults the page states that the class does not have (key, page, class): {wrong}"


def check_types(table: list[dict[str, str]], rules: Mapping[str, Number]) -> None:
    wrong = [(key, row["type"], str(rules[key])) for row in table if (key := key_of(row["key"])) in rules
             if str(rules[key]).removeprefix("a ") not in row["type"]]
    assert wrong == [], f"numbers the page types otherwise than the config checks them (key, page, rule): {wrong}"


def test_the_config_page_lists_exactly_the_top_level_keys_with_their_defaults() -> None:
    (table,) = config_tables()["Top level"]
    page = keys(table)
    taken = {key for key in candidates(EngineConfig, page, TOP_SAMPLES, _TOP_LEVEL)
             if loads({key: sample(TOP_SAMPLES, EngineConfig, key, _TOP_LEVEL)})}
    assert sorted(page) == sorted(taken)
    check_defaults(table, EngineConfig)
    check_types(table, {"max_in_flight": COUNT, "threads": COUNT})


def test_the_config_page_lists_exactly_the_defaults_tables_keys_with_their_defaults() -> None:
    (table,) = config_tables()["[defaults]"]
    page = keys(table)
    taken = {key for key in candidates(Limits, page, LIMIT_SAMPLES)
             if loads({"defaults": {key: sample(LIMIT_SAMPLES, Limits, key)}})}
    assert sorted(page) == sorted(taken)
    check_defaults(table, Limits)
    check_types(table, _LIMITS)


def test_the_config_page_says_what_each_kinds_refs_table_takes() -> None:
    """The refs table's rows are every key some kind takes; each kind's column says "refused" exactly where
    the loader refuses the key in that kind's table."""
    table, by_kind = config_tables()['[refs."<verifier>"]']
    page = keys(table)
    taken = {
        kind: {key for key in candidates(Limits, page, LIMIT_SAMPLES)
               if loads({"refs": {ref: {key: sample(LIMIT_SAMPLES, Limits, key)}}, **REFS_NEEDS.get(key, {})})}
        for kind, ref in REF_KEYS.items()
    }
    assert sorted(page) == sorted(set().union(*taken.values()))
    assert keys(by_kind) == page
    for kind in KINDS:
        said = {key_of(row["key"]) for row in by_kind if not row[kind].startswith("refused")}
        assert said == taken[kind], kind
    check_defaults(table, Limits)
    check_types(table, _LIMITS)


def test_the_config_page_lists_exactly_the_judges_keys_with_their_defaults() -> None:
    (table,) = config_tables()["[judge]"]
    page = keys(table)
    taken = {key for key in candidates(JudgeConfig, page, JUDGE_SAMPLES)
             if loads({"judge": {**JUDGE_BASE, **JUDGE_NEEDS.get(key, {}),
                                 key: sample(JUDGE_SAMPLES, JudgeConfig, key)}})}
    assert sorted(page) == sorted(taken)
    required = {key_of(row["key"]) for row in table if row["default"].startswith(REQUIRED)}
    assert required == {key for key in JUDGE_BASE if not loads({"judge": {k: v for k, v in JUDGE_BASE.items()
                                                                           if k != key}})}
    check_defaults(table, JudgeConfig)
    check_types(table, _JUDGE)


def test_the_config_page_lists_exactly_the_caches_keys_with_their_defaults() -> None:
    (table,) = config_tables()["[cache]"]
    page = keys(table)
    taken = {key for key in candidates(CacheConfig, page, CACHE_SAMPLES)
             if loads({"cache": {**CACHE_BASE, key: sample(CACHE_SAMPLES, CacheConfig, key)}})}
    assert sorted(page) == sorted(taken)
    required = {key_of(row["key"]) for row in table if row["default"].startswith(REQUIRED)}
    assert required == {"path"} and not loads({"cache": {}})
    check_defaults(table, CacheConfig)
    check_types(table, _CACHE)


def test_the_config_page_keys_pins_by_environment() -> None:
    (table,) = config_tables()["[pins]"]
    assert keys(table) == ["<environment>"]
    assert not loads({"pins": {"exact": "sha256:" + "0" * 63}})  # the form its type cell states


def test_the_complete_example_uses_every_key_of_every_table() -> None:
    """The page's complete engine.toml (which its own blocks load and open) sets every key the tables list."""
    (example,) = [block for block in blocks(CONFIG_PAGE) if block.title == "engine.toml"][-1:]
    data = tomllib.loads(example.body)
    found = config_tables()

    def covers(written: set[str], table: list[dict[str, str]]) -> None:
        """``written`` is every key of ``table`` but those left out to keep a default of none (TOML has no null)."""
        unwritable = {key_of(row["key"]) for row in table if stated_default(row["default"]) is None}
        assert written <= set(keys(table)) and set(keys(table)) - written <= unwritable, sorted(written)

    covers(set(data), found["Top level"][0])
    covers(set(data["defaults"]), found["[defaults]"][0])
    covers(set().union(*data["refs"].values()), found['[refs."<verifier>"]'][0])
    covers(set(data["judge"]), found["[judge]"][0])
    covers(set(data["cache"]), found["[cache]"][0])
    columns = found["[input.columns]"][0]
    assert {key if "." not in key or key.split(".")[0] != "task" else "task.<key>" for key in data["input"]["columns"]
            } <= set(keys(columns))
    assert sorted(data["refs"]) == sorted(REF_KEYS.values())


def test_the_config_page_lists_the_fields_a_column_mapping_takes() -> None:
    """``[input.columns]``'s rows are the fields a mapping takes, each refused under another name, read by default
    from the column of its own name."""
    (table,) = config_tables()["[input.columns]"]
    page = keys(table)
    plain = [key for key in page if key != "task.<key>"]
    assert all(loads({"input": {"columns": {key: "elsewhere"}}}) for key in plain)
    assert loads({"input": {"columns": {"task.prompt": "prompt"}}}) and "task.<key>" in page
    assert not loads({"input": {"columns": {"enviroment": "data_source"}}})
    assert {key_of(row["key"]): stated_default(row["default"]) for row in table if row["key"] != "`task.<key>`"} == {
        key: key for key in plain}


def test_a_default_cell_is_read_or_refused() -> None:
    """The reading of a default cell can fail: a wrong default is found, and words it does not know are refused."""
    assert stated_default("`60.0`") == 60.0 and stated_default("none (unlimited)") is None
    assert not same_default(stated_default("`61.0`"), class_default(Limits, "timeout"))
    assert not same_default(stated_default("`1`"), True)
    with pytest.raises(AssertionError):
        stated_default("sixty")


# --- the manifest page ---

MANIFEST_BASE: dict[str, Any] = {"kind": "environment", "verifier": {"kind": "plugin", "ref": "verify:score"}}
MANIFEST_SAMPLES: dict[str, Any] = {
    "kind": "environment", "verifier": {"kind": "endpoint", "ref": "http://127.0.0.1:18731/score"},
    "version": "1.2", "description": "what it scores", "example": {"task": {"reference": "4"}, "trajectory": "4"},
}
# what a verifier object's key needs beside it to be valid: workers need the process executor
VERIFIER_SAMPLES: dict[str, dict[str, Any]] = {
    "kind": {}, "ref": {}, "executor": {"executor": "process"}, "workers": {"executor": "process", "workers": 2},
}


def manifest_tables() -> dict[str, list[list[dict[str, str]]]]:
    return {heading: tables(body) for heading, body in sections(MANIFEST_PAGE).items()}


def manifest_loads(directory: Path, manifest: Mapping[str, Any]) -> bool:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "manifest.json").write_bytes(orjson.dumps(manifest))
    try:
        load_environment(directory)
    except ManifestError:
        return False
    return True


def verifier_loads(kind: str, extra: Mapping[str, Any]) -> bool:
    try:
        parse_verifier({"kind": kind, "ref": REFS[kind], **extra}, Path("manifest.json"))
    except ManifestError:
        return False
    return True


def test_the_manifest_page_lists_exactly_the_top_level_keys(tmp_path: Path) -> None:
    (table,) = manifest_tables()["Top level"]
    page = keys(table)
    assert set(MANIFEST_KEYS) <= set(MANIFEST_SAMPLES), "a new manifest key: give it a sample here, then a row"
    taken = {key for key in set(MANIFEST_KEYS) | set(page) | set(MANIFEST_SAMPLES)
             if manifest_loads(tmp_path / key, {**MANIFEST_BASE, key: MANIFEST_SAMPLES.get(key, 1)})}
    assert sorted(page) == sorted(taken)
    required = {key_of(row["key"]) for row in table if row["default"].startswith(REQUIRED)}
    left_out = {key for key in MANIFEST_BASE if not manifest_loads(
        tmp_path / f"without-{key}", {k: v for k, v in MANIFEST_BASE.items() if k != key})}
    assert required == left_out


def test_the_manifest_page_lists_exactly_the_verifier_objects_keys_and_their_kinds() -> None:
    table, refs = manifest_tables()["The verifier object"]
    assert sorted(key_of(row["kind"]) for row in refs) == sorted(KINDS)
    page = keys(table)
    spec_fields = {f.name for f in dataclasses.fields(VerifierSpec)} | set(_PLUGIN_KEYS)
    assert spec_fields <= set(VERIFIER_SAMPLES), "a new verifier key: give it a sample here, then a row"
    for row in table:
        key = key_of(row["key"])
        kinds = [kind for kind in KINDS if verifier_loads(kind, VERIFIER_SAMPLES.get(key, {key: 1}))]
        assert kinds, f"{key!r}: no kind's verifier takes it"
        said = "all" if len(kinds) == len(KINDS) else ", ".join(sorted(kinds))
        assert row["kinds"] == said, key
    taken = {key for key in spec_fields | set(page)
             if any(verifier_loads(kind, VERIFIER_SAMPLES.get(key, {key: 1})) for kind in KINDS)}
    assert sorted(page) == sorted(taken)
    check_defaults(table, VerifierSpec)
