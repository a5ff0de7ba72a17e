"""What a plugin receives from an input row through ``engine score`` and ``engine bench``: what the row holds.

Two real plugin environments judge it: ``wide_int`` scores 1.0 only for a task whose ``reference``
is exactly the integer 2**64 + 1, ``exact_trajectory`` only for a trajectory exactly equal to the
task's ``expected``, types included. A value changed on the way in (a rounded integer, a text
decoded into a list) would score 0.0 with exit 0: every test asserts the rewards written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_support import Workspace, make_workspace, records

from engine import _json
from engine._backfill.parquet import JSON_COLUMNS_KEY
from engine.cli import EXIT_BAD_INPUT

WIDE = 2**64 + 1  # orjson reads it as 1.8446744073709552e+19
# trajectories a JSON Lines row holds as text: the raw completion of a JSON-format verifier, text that merely
# looks like JSON, and plain text; stored in Parquet as text, each must reach the plugin as the same text
TEXTS = ['{"answer": 4}', "[1, 2]", '  {"content": "obj"}', "the answer is 4", "42"]
MESSAGES = [{"role": "assistant", "content": "4"}]


@pytest.fixture
def space(tmp_path: Path) -> Workspace:
    return make_workspace(tmp_path, "wide_int", "exact_trajectory")


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(_json.dumps(row) + b"\n" for row in rows))  # every integer written exactly
    return path


def write_text_parquet(path: Path, rows: list[dict[str, Any]], *, text: tuple[str, ...] = ("task",),
                       listed: str | None = None) -> Path:
    """``rows`` as Parquet through pandas, as a data frame writes them: the ``text`` columns as JSON text (strings);
    ``listed``: the schema metadata ``engine.json_columns``."""
    frame = pd.DataFrame({key: [_json.dumps(r[key]).decode() if key in text else r[key] for r in rows]
                          for key in ("id", "environment", "task", "trajectory")})
    table = pa.Table.from_pandas(frame, preserve_index=False)
    if listed is not None:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), JSON_COLUMNS_KEY: listed.encode()})
    pq.write_table(table, path)
    return path


def rewards(out: Path) -> list[float]:
    return [record.reward for record in records(out)]


def wide_rows(count: int) -> list[dict[str, Any]]:
    return [{"id": f"w{n}", "environment": "wide_int", "task": {"reference": WIDE, "n": n}, "trajectory": "t"}
            for n in range(count)]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_task_integer_wider_than_64_bits_reaches_the_plugin_exactly(space: Workspace, suffix: str) -> None:
    source = space.root / f"in{suffix}"
    if suffix == ".jsonl":
        write_jsonl(source, wide_rows(3))
    else:
        write_text_parquet(source, wide_rows(3))  # the task as JSON text
    out = space.root / "out.jsonl"

    ran = space.score(source, out)

    assert ran.returncode == 0, ran.stderr
    assert rewards(out) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_an_id_wider_than_64_bits_is_refused_naming_its_row_and_shown_exactly(space: Workspace, suffix: str) -> None:
    items = wide_rows(3)
    items[1]["id"] = WIDE
    source = space.root / f"in{suffix}"
    if suffix == ".jsonl":
        write_jsonl(source, items)
    else:  # an id column of JSON text, as the engine's own output writes mixed ids, and says so in its metadata
        write_text_parquet(source, items, text=("id", "task"), listed="id")

    ran = space.score(source, space.root / "out.jsonl")

    assert ran.returncode == EXIT_BAD_INPUT, ran.stderr
    where = "line 2" if suffix == ".jsonl" else "row 2"
    assert f"{where}: 'id' 18446744073709551617: an integer id must fit in 64 bits" in ran.stderr
    assert "e+19" not in ran.stderr


def text_rows(trajectories: list[Any], expected: list[Any] | None = None) -> list[dict[str, Any]]:
    expected = trajectories if expected is None else expected
    return [{"id": n, "environment": "exact_trajectory", "task": {"expected": want}, "trajectory": trajectory}
            for n, (trajectory, want) in enumerate(zip(trajectories, expected, strict=True))]


def test_a_text_trajectory_reaches_the_plugin_as_the_same_text_from_json_lines_and_parquet(space: Workspace) -> None:
    items = text_rows(TEXTS)
    jsonl = write_jsonl(space.root / "in.jsonl", items)
    parquet = write_text_parquet(space.root / "in.parquet", items, text=("task",))  # trajectory: plain strings

    for number, source in enumerate((jsonl, parquet)):
        out = space.root / f"out-{number}.jsonl"
        ran = space.score(source, out)
        assert ran.returncode == 0, ran.stderr
        assert rewards(out) == [1.0] * len(TEXTS), source


def test_a_trajectory_of_json_text_is_decoded_where_the_file_or_the_command_says_so(space: Workspace) -> None:
    items = text_rows([MESSAGES, {"answer": 4}, "plain"])  # nested values, stored as JSON text
    flagged = write_text_parquet(space.root / "flagged.parquet", items, text=("task", "trajectory"))
    listed = write_text_parquet(space.root / "listed.parquet", items, text=("task", "trajectory"),
                                listed="task,trajectory")

    as_text = space.score(flagged, space.root / "text.jsonl")
    decoded = space.score(flagged, space.root / "flag.jsonl", "--json-columns", "trajectory")
    by_metadata = space.score(listed, space.root / "meta.jsonl")

    assert as_text.returncode == decoded.returncode == by_metadata.returncode == 0, as_text.stderr + decoded.stderr
    assert rewards(space.root / "text.jsonl") == [0.0, 0.0, 0.0]  # texts, not the values: as the file holds them
    assert rewards(space.root / "flag.jsonl") == [1.0, 1.0, 1.0]
    assert rewards(space.root / "meta.jsonl") == [1.0, 1.0, 1.0]
    bench = space.run("bench", flagged, "--config", space.config, "--json-columns", "task,trajectory", "--json")
    assert bench.returncode == 0, bench.stderr
    assert _json.loads(bench.stdout)["verifiers"][0]["mean_reward"] == 1.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--json-columns", "trajectory,id"], "task and trajectory only, not 'id'"),
        (["--json-columns", "reward"], "task and trajectory only, not 'reward'"),
    ],
)
def test_json_columns_other_than_task_and_trajectory_are_a_usage_error(
    space: Workspace, args: list[str], message: str
) -> None:
    source = write_text_parquet(space.root / "in.parquet", text_rows(["x"]))
    commands = (["score", source, "-o", space.root / "out.jsonl"], ["bench", source],
                ["score", source, "-o", space.root / "outdir", "--ray"])
    for command in commands:
        ran = space.run(*command, "--config", space.config, *args)
        assert ran.returncode == EXIT_BAD_INPUT, ran.stderr
        assert message in ran.stderr
    jsonl = write_jsonl(space.root / "in.jsonl", text_rows(["x"]))
    ran = space.score(jsonl, space.root / "out.jsonl", "--json-columns", "trajectory")
    assert ran.returncode == EXIT_BAD_INPUT and "--json-columns is for Parquet input" in ran.stderr


def test_a_struct_task_whose_rows_differ_in_keys_is_refused_never_given_other_rows_keys(space: Workspace) -> None:
    frame = pd.DataFrame({  # pandas dicts: pyarrow makes one struct of every row's keys
        "id": [1, 2],
        "environment": ["exact_trajectory"] * 2,
        "task": [{"expected": "a"}, {"expected": "b", "hint": "only row 2 has one"}],
        "trajectory": ["a", "b"],
    })
    source = space.root / "in.parquet"
    frame.to_parquet(source, index=False)
    assert pq.read_table(source).column("task").to_pylist()[0] == {"expected": "a", "hint": None}

    ran = space.score(source, space.root / "out.jsonl")

    assert ran.returncode == EXIT_BAD_INPUT, ran.stderr
    assert "row 1: task.hint is null in a struct column" in ran.stderr
    assert "store 'task' as JSON text" in ran.stderr


def test_a_resume_with_nothing_checkpointed_yet_reads_json_text_columns_again(space: Workspace) -> None:
    """--json-columns on Parquet: a run stopped before its first checkpoint resumes (it was refused as changed)."""
    items = [{"id": n, "environment": "exact_trajectory", "task": _json.dumps({"expected": [n]}).decode(),
              "trajectory": _json.dumps([n]).decode()} for n in range(6)]
    items[1]["task"] = "{not json"
    source = space.root / "in.parquet"
    pq.write_table(pa.table({key: [item[key] for item in items] for key in items[0]}), source)
    out = space.root / "out.jsonl"

    failed = space.score(source, out, "--json-columns", "trajectory")
    assert failed.returncode == EXIT_BAD_INPUT and "row 2: 'task' is text but not valid JSON" in failed.stderr
    items[1]["task"] = _json.dumps({"expected": [1]}).decode()
    pq.write_table(pa.table({key: [item[key] for item in items] for key in items[0]}), source)
    resumed = space.score(source, out, "--json-columns", "trajectory", "--resume")

    assert resumed.returncode == 0, resumed.stderr
    assert rewards(out) == [1.0] * 6
