"""The column mapping (``--columns``, ``[input.columns]``): rows whose fields live in other columns, or deeper.

verl's own Parquet (``data_source``, ``prompt`` as a list of message structs, ``reward_model`` and ``extra_info``
structs) is scored as it is, and the same rows as JSON Lines; the ``verl_gsm8k`` plugin raises for a task of any
other shape than ``prompt`` and a text ``reference``, so a mapping that read the wrong thing fails instead of
scoring 0. Every test asserts the rewards and ids written, or that nothing was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_support import (
    VERL_COLUMNS,
    Workspace,
    make_workspace,
    read_log,
    records,
    verl_reward,
    verl_rows,
)

from engine import ConfigError, EngineConfig, _json, load_config
from engine.cli import EXIT_BAD_INPUT, EXIT_VERIFICATION

VERL_TABLE = """
[input.columns]
environment = "data_source"
id = "extra_info.index"
trajectory = "response"
task.prompt = "prompt"
task.reference = "reward_model.ground_truth"
"""


@pytest.fixture
def space(tmp_path: Path) -> Workspace:
    return make_workspace(tmp_path, "verl_gsm8k", "wide_int", "backfill")


def write_verl(path: Path, items: list[dict[str, Any]]) -> Path:
    """``items`` as verl writes them (Parquet through Arrow, whose structs and lists of structs these become), or
    as JSON Lines."""
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(items), path, row_group_size=4)
    else:
        path.write_bytes(b"".join(_json.dumps(item) + b"\n" for item in items))
    return path


def scored(out: Path) -> list[tuple[Any, float]]:
    return [(record.id, record.reward) for record in records(out)]


def expected(count: int) -> list[tuple[Any, float]]:
    return [(1000 + n, verl_reward(n)) for n in range(count)]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_verls_own_rows_are_scored_through_the_mapping_their_ids_kept_as_mapped(space: Workspace, suffix: str) -> None:
    source = write_verl(space.root / f"in{suffix}", verl_rows(10))
    out = space.root / "out.jsonl"

    unmapped = space.score(source, space.root / "unmapped.jsonl")
    ran = space.score(source, out, "--columns", VERL_COLUMNS)

    assert unmapped.returncode == EXIT_BAD_INPUT  # the fixed columns are not there
    assert ran.returncode == 0, ran.stderr
    assert scored(out) == expected(10)  # ints from extra_info.index; a text ground truth compared as text
    assert [record.verifier["environment"] for record in records(out)] == ["verl_gsm8k"] * 10
    bench = space.run("bench", source, "--config", space.config, "--columns", VERL_COLUMNS, "--json")
    assert bench.returncode == 0, bench.stderr
    assert _json.loads(bench.stdout)["verifiers"][0]["mean_reward"] == pytest.approx(6 / 10)


def test_the_mapping_in_engine_toml_is_read_and_columns_replaces_it_whole(space: Workspace) -> None:
    space.write_config(VERL_TABLE)
    source = write_verl(space.root / "in.parquet", verl_rows(6))

    from_config = space.score(source, space.root / "config.jsonl")
    # extra_info.answer ends with "#### <the right answer>": every row scores 1.0 when the trajectory is read there
    replaced = space.score(source, space.root / "replaced.jsonl", "--columns",
                           VERL_COLUMNS.replace("trajectory=response", "trajectory=extra_info.answer"))
    partial = space.score(source, space.root / "partial.jsonl", "--columns", "trajectory=extra_info.answer")

    assert from_config.returncode == 0, from_config.stderr
    assert scored(space.root / "config.jsonl") == expected(6)
    assert replaced.returncode == 0, replaced.stderr
    assert scored(space.root / "replaced.jsonl") == [(1000 + n, 1.0) for n in range(6)]
    assert partial.returncode == EXIT_BAD_INPUT  # not merged: environment and the rest are their own columns again
    assert "missing column(s) 'id', 'environment', 'task'; the file has columns 'data_source'" in partial.stderr
    assert not (space.root / "partial.jsonl").exists()


def test_a_wide_integer_reached_by_a_path_stays_exact_as_do_wide_ids(space: Workspace) -> None:
    items = [{"key": 2**63 + n, "env": "wide_int", "meta": {"answer": 2**64 + 1, "n": n}, "out": "t"}
             for n in range(3)]
    source = write_verl(space.root / "in.jsonl", items)
    out = space.root / "out.jsonl"

    ran = space.score(source, out, "--columns", "id=key,environment=env,task.reference=meta.answer,trajectory=out")

    assert ran.returncode == 0, ran.stderr
    assert scored(out) == [(2**63 + n, 1.0) for n in range(3)]  # the plugin gave 1.0: it got 2**64 + 1 exactly


def _null_struct(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    items[1]["reward_model"] = None
    return items


def _null_index(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    items[1]["extra_info"]["index"] = None
    return items


def _no_ground_truth(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    del items[2]["reward_model"]["ground_truth"]
    return items


@pytest.mark.parametrize(
    ("suffix", "columns", "change", "message"),
    [
        (".parquet", VERL_COLUMNS.replace("=data_source", "=source"), None,
         "in.parquet: missing column(s) 'source' (read as environment); the file has columns 'data_source', "),
        (".parquet", VERL_COLUMNS.replace("ground_truth", "answer"), None,
         "in.parquet: missing field 'reward_model.answer' (read as task.reference): 'reward_model' has fields "
         "'style', 'ground_truth'"),
        (".parquet", VERL_COLUMNS.replace("extra_info.index", "ability.index"), None,
         "in.parquet: 'ability.index' (read as id) cannot be read: 'ability' is string, not a struct"),
        (".parquet", VERL_COLUMNS, _null_struct,
         "in.parquet: row 2: 'reward_model.ground_truth' (read as task.reference) cannot be read: 'reward_model' "
         "is null"),
        (".parquet", VERL_COLUMNS, _null_index, "in.parquet: row 2: extra_info.index is null in a struct column"),
        (".jsonl", VERL_COLUMNS, _no_ground_truth,
         "in.jsonl: line 3: missing field(s) 'reward_model.ground_truth' (read as task.reference)"),
        (".jsonl", VERL_COLUMNS, _null_struct,
         "in.jsonl: line 2: 'reward_model.ground_truth' (read as task.reference) cannot be read: 'reward_model' "
         "is null"),
        (".jsonl", VERL_COLUMNS.replace("=data_source", "=source"), None,
         "in.jsonl: line 1: missing field(s) 'source' (read as environment)"),
        (".jsonl", VERL_COLUMNS.replace("extra_info.index", "ability.index"), None,
         "in.jsonl: line 1: 'ability.index' (read as id) cannot be read: 'ability' is a string, not an object"),
    ],
    ids=["column", "struct-field", "not-a-struct", "null-struct", "null-field", "jsonl-key", "jsonl-null",
         "jsonl-column", "jsonl-not-an-object"],
)
def test_a_source_a_row_or_file_lacks_is_an_error_naming_it_never_a_default(
    space: Workspace, suffix: str, columns: str, change: Any, message: str
) -> None:
    items = verl_rows(4)
    source = write_verl(space.root / f"in{suffix}", change(items) if change else items)
    out = space.root / "out.jsonl"

    ran = space.score(source, out, "--columns", columns)

    assert ran.returncode == EXIT_BAD_INPUT, ran.stderr
    assert message in ran.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ("enviroment=data_source", "enviroment: unknown key, did you mean 'environment'? (known: environment, id, "
         "task, task.<key>, trajectory)"),
        ("environment", "'environment' is not field=source"),
        ("id=a..b", "id: must be a source column, dotted into a struct or object"),
        ("id=a,id=b", "id: named twice"),
        ("task=t,task.reference=r", "task: the task is either one column or built of task.<key> entries, not both"),
        ("task.a.b=c", "task.a.b: unknown key"),
    ],
)
def test_a_mapping_that_is_not_one_is_a_usage_error_of_every_command(
    space: Workspace, columns: str, message: str
) -> None:
    source = write_verl(space.root / "in.parquet", verl_rows(2))
    commands = (["score", source, "-o", space.root / "out.jsonl"], ["bench", source],
                ["score", source, "-o", space.root / "outdir", "--ray"])
    for command in commands:
        ran = space.run(*command, "--config", space.config, "--columns", columns)
        assert ran.returncode == EXIT_BAD_INPUT, ran.stderr
        assert "Invalid value for '--columns'" in ran.stderr and message in ran.stderr, ran.stderr
    assert not (space.root / "out.jsonl").exists() and not (space.root / "outdir").exists()


@pytest.mark.parametrize(
    ("text", "key", "said"),
    [
        ('[input.columns]\nenviroment = "data_source"', "input.columns.enviroment", "did you mean 'environment'?"),
        ('[input.columns]\nid = 5', "input.columns.id", "must be a source column"),
        ('[input.columns]\ntask = "t"\n"task.reference" = "r"', "input.columns.task", "not both"),
        ('[input.columns.task]\n"a.b" = "c"', "input.columns.task.a.b", "unknown key"),
        ("[input]\ncolums = {}", "input.colums", "unknown key, did you mean 'columns'? (known: columns)"),
        ("[input]\ncolumns = 5", "input.columns", "must be a table"),
        ("input = 5", "input", "must be a table"),
    ],
)
def test_a_bad_input_columns_table_names_its_key_and_the_file(
    space: Workspace, text: str, key: str, said: str
) -> None:
    space.config.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(space.config)
    assert str(info.value).startswith(f"{space.config}: {key}: "), info.value
    assert said in str(info.value)
    source = write_verl(space.root / "in.parquet", verl_rows(2))
    ran = space.score(source, space.root / "out.jsonl")
    assert ran.returncode == EXIT_BAD_INPUT and f"{key}: " in ran.stderr


def test_the_configs_mapping_is_validated_flat_and_read_only_when_built_in_code() -> None:
    config = EngineConfig(input_columns={"environment": "data_source", "task": {"reference": "reward_model.answer"}})
    assert dict(config.input_columns) == {"id": "id", "environment": "data_source",
                                          "task.reference": "reward_model.answer", "trajectory": "trajectory"}
    assert dict(EngineConfig(input_columns={"id": "id"}).input_columns) == {}  # the default, said outright
    with pytest.raises(TypeError):
        config.input_columns["id"] = "x"  # type: ignore[index]
    with pytest.raises(ConfigError, match=r"^input.columns.trajectroy: unknown key, did you mean 'trajectory'\?"):
        EngineConfig(input_columns={"trajectroy": "response"})


def test_a_resume_reads_with_the_mapping_it_started_with(space: Workspace) -> None:
    """Renamed columns and a row lacking one: the run stops at it; a resume with the same mapping finishes (even
    with nothing checkpointed yet), one with another mapping is refused before reading on."""
    mapping = "environment=env,task=job,trajectory=answer"
    items = [{"id": f"row-{n}", "env": "backfill", "job": {"n": n}, "answer": f"answer {n}"} for n in range(12)]
    source = space.root / "in.jsonl"
    reference = space.root / "reference.jsonl"
    write_verl(source, items)
    assert space.score(source, reference, "--columns", mapping, "--chunk-size", "4").returncode == 0
    log = space.root / "calls.log"
    knobs = {"ENGINE_TEST_CALL_LOG": str(log)}  # the backfill plugin logs each row it scores

    for bad in (1, 9):  # in the first chunk (nothing checkpointed), then in the third
        out = space.root / f"out-{bad}.jsonl"
        broken = [dict(item) for item in items]
        del broken[bad]["job"]
        write_verl(source, broken)
        failed = space.score(source, out, "--columns", mapping, "--chunk-size", "4", env=knobs)
        assert failed.returncode == EXIT_BAD_INPUT, failed.stderr
        assert f"line {bad + 1}: missing field(s) 'job' (read as task)" in failed.stderr
        write_verl(source, items)
        if bad == 9:
            other = space.score(source, out, "--columns", "environment=env,task=job,trajectory=id", "--resume")
            default = space.score(source, out, "--resume")
            assert other.returncode == default.returncode == EXIT_BAD_INPUT, other.stderr + default.stderr
            assert "the input changed since the run started" in other.stderr + default.stderr
        log.unlink(missing_ok=True)
        resumed = space.score(source, out, "--columns", mapping, "--chunk-size", "4", "--resume", env=knobs)
        assert resumed.returncode == 0, resumed.stderr
        assert out.read_bytes() == reference.read_bytes()
        assert sorted(read_log(log)) == list(range(bad // 4 * 4, 12))  # from the chunk it stopped in


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_the_check_before_scoring_reads_each_rows_environment_where_the_mapping_says(
    tmp_path: Path, suffix: str
) -> None:
    """An environment read from a struct field (or a nested object) is checked before the first row, as a plain
    column's is: a broken one after 1,000 good rows stops the run with nothing scored, named."""
    space = make_workspace(tmp_path, "verl_gsm8k", "broken_import")
    items = verl_rows(1000) + verl_rows(1, first=1000)
    for n, item in enumerate(items):
        item["extra_info"]["env"] = "broken_import" if n == 1000 else "verl_gsm8k"
    source = write_verl(space.root / f"in{suffix}", items)
    out = space.root / "out.jsonl"
    mapping = VERL_COLUMNS.replace("environment=data_source", "environment=extra_info.env")

    ran = space.score(source, out, "--columns", mapping)

    assert ran.returncode == EXIT_VERIFICATION, ran.stderr
    assert "broken_import" in ran.stderr and "checked before scoring any row" in ran.stderr, ran.stderr
    assert not out.exists() and not Path(f"{out}.partial").exists()  # nothing scored
