"""engine._backfill.input: streaming stored trajectories from JSON Lines and Parquet, validation, skip and checksum."""

from __future__ import annotations

import hashlib
from itertools import islice
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine import EngineError, InputError, ManifestError
from engine._backfill.files import EMPTY_CHECKSUM
from engine._backfill.input import BATCH_ROWS, Row, RowDecoder, open_rows
from engine._backfill.parquet import JSON_COLUMNS_KEY

TASKS: list[dict[str, Any]] = [{"a": 1, "b": 2}, {"question": "2+2?", "answer": "4"}, {"nested": {"x": [1, 2, 3]}}]
TRAJECTORIES: list[Any] = [
    "plain text answer",
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "4"}],
    {"content": "an object"},
]


def rows_data(n: int) -> list[dict[str, Any]]:
    """``n`` distinct rows cycling through nested tasks and trajectories of every shape."""
    return [
        {
            "id": f"r{i}",
            "environment": "arith",
            "task": {**TASKS[i % len(TASKS)], "i": i},
            "trajectory": TRAJECTORIES[i % len(TRAJECTORIES)],
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict[str, Any]], *, blank_every: int = 0) -> Path:
    """One object a line; with ``blank_every``, a blank line before every ``blank_every``-th row."""
    with path.open("wb") as f:
        for i, row in enumerate(rows):
            if blank_every and i % blank_every == 0:
                f.write(b"\n")
            f.write(orjson.dumps(row) + b"\n")
    return path


def write_parquet(
    path: Path, columns: dict[str, list[Any]], *, row_group_size: int | None = None, json_text: str | None = None
) -> Path:
    """``columns`` as Parquet; ``json_text``: the schema metadata ``engine.json_columns`` (the columns of JSON text)."""
    table = pa.table(columns)
    if json_text is not None:
        table = table.replace_schema_metadata({JSON_COLUMNS_KEY: json_text.encode()})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def nested_columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Parquet columns: ``task`` a struct; ``trajectory`` JSON text (it mixes shapes), to be listed as such."""
    return {
        "id": [r["id"] for r in rows],
        "environment": [r["environment"] for r in rows],
        "task": [{"i": r["task"]["i"], "label": str(r["task"])} for r in rows],
        "trajectory": [orjson.dumps(r["trajectory"]).decode() for r in rows],
    }


def write_nested(path: Path, rows: list[dict[str, Any]], *, row_group_size: int | None = None) -> Path:
    """``rows`` as :func:`nested_columns`, the file's metadata listing ``trajectory`` as JSON text."""
    return write_parquet(path, nested_columns(rows), row_group_size=row_group_size, json_text="trajectory")


# --- JSON Lines -------------------------------------------------------------------------------


def test_jsonl_round_trip_with_blank_lines_keeps_line_numbers(tmp_path: Path) -> None:
    data = rows_data(7)
    path = write_jsonl(tmp_path / "in.jsonl", data, blank_every=3)
    with open_rows(path) as rows:
        got = list(rows)
        assert rows.rows_read == 7
        assert rows.unit == "line"
    assert [(r.id, r.environment, r.task, r.trajectory) for r in got] == [
        (d["id"], d["environment"], d["task"], d["trajectory"]) for d in data
    ]
    # a blank line precedes rows 0, 3 and 6, so rows sit on lines 2,3,4, 6,7,8, 10
    assert [r.number for r in got] == [2, 3, 4, 6, 7, 8, 10]
    lines = path.read_bytes().split(b"\n")
    assert all(orjson.loads(lines[r.number - 1])["id"] == r.id for r in got)


@pytest.mark.parametrize("suffix", [".jsonl", ".ndjson", ".json-lines", ".JSONL"])
def test_jsonl_extensions(tmp_path: Path, suffix: str) -> None:
    path = write_jsonl(tmp_path / f"in{suffix}", rows_data(2))
    with open_rows(path) as rows:
        assert [r.id for r in rows] == ["r0", "r1"]


def test_jsonl_strings_are_never_decoded(tmp_path: Path) -> None:
    # In JSON Lines values are already JSON: a string that looks like JSON stays a string.
    row = {"id": 1, "environment": "arith", "task": {}, "trajectory": '[{"content": "x"}]'}
    path = write_jsonl(tmp_path / "in.jsonl", [row])
    with open_rows(path) as rows:
        assert next(rows).trajectory == '[{"content": "x"}]'


def test_row_as_item(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", rows_data(1))
    with open_rows(path) as rows:
        row = next(rows)
    assert row.as_item() == rows_data(1)[0]
    assert isinstance(row, Row)


def test_last_line_without_newline_and_crlf(tmp_path: Path) -> None:
    a, b = (orjson.dumps(r) for r in rows_data(2))
    path = tmp_path / "in.jsonl"
    path.write_bytes(a + b"\r\n\r\n" + b)
    with open_rows(path) as rows:
        got = list(rows)
    assert [(r.number, r.id) for r in got] == [(1, "r0"), (3, "r1")]


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b'{"id": 1, "environment": "arith", "task": {}', "invalid JSON"),
        (b"\xff\xfe not utf-8", "invalid UTF-8 at byte 1 of line 4 (counted from 1 within the line"),
        (b'{"id": "r\xc3(", "environment": "arith", "task": {}}', "invalid UTF-8 at byte 10 of line 4"),
        (b'[1, 2, 3]', "must be a JSON object, got list"),
        (b'"just a string"', "must be a JSON object, got str"),
        (b'{"environment": "arith", "task": {}, "trajectory": ""}', "missing field(s) 'id'"),
        (b'{"id": 1, "task": {}, "trajectory": ""}', "missing field(s) 'environment'"),
        (b'{"id": 1, "environment": "arith", "trajectory": ""}', "missing field(s) 'task'"),
        (b'{"id": 1, "environment": "arith", "task": {}}', "missing field(s) 'trajectory'"),
        (b'{"id": 1, "environment": "arith"}', "missing field(s) 'task', 'trajectory'"),
        (b'{"id": 1, "environment": "arith", "task": [1], "trajectory": ""}', "'task' must be an object, got list"),
        (b'{"id": 1, "environment": "arith", "task": "{}", "trajectory": ""}', "'task' must be an object, got str"),
        (b'{"id": 1, "environment": 7, "task": {}, "trajectory": ""}', "'environment' must be an environment's name"),
        (b'{"id": 1, "environment": "", "task": {}, "trajectory": ""}', "'environment' must be an environment's name"),
    ],
)
def test_jsonl_bad_row_names_its_line(tmp_path: Path, line: bytes, reason: str) -> None:
    path = tmp_path / "in.jsonl"
    good = [orjson.dumps(r) for r in rows_data(2)]
    path.write_bytes(good[0] + b"\n\n" + good[1] + b"\n" + line + b"\n" + good[0] + b"\n")
    with open_rows(path) as rows:
        assert next(rows).number == 1
        assert next(rows).number == 3
        with pytest.raises(InputError) as info:
            next(rows)
    err = info.value
    assert (err.path, err.unit, err.number) == (path, "line", 4)
    assert reason in err.reason
    assert str(err).startswith(f"{path}: line 4: ")
    assert isinstance(err, EngineError) and isinstance(err, ValueError)


# --- Parquet ----------------------------------------------------------------------------------


def test_parquet_nested_values(tmp_path: Path) -> None:
    trajectories = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": f"a{i}"}] for i in range(3)]
    path = write_parquet(
        tmp_path / "in.parquet",
        {
            "id": [10, 11, 12],
            "environment": ["arith", "length", "arith"],
            "task": [{"x": i, "y": f"s{i}"} for i in range(3)],
            "trajectory": trajectories,
            "ignored": ["a", "b", "c"],
        },
    )
    with open_rows(path) as rows:
        got = list(rows)
        assert rows.unit == "row"
    assert [r.number for r in got] == [1, 2, 3]
    assert [r.id for r in got] == [10, 11, 12]
    assert [r.environment for r in got] == ["arith", "length", "arith"]
    assert [r.task for r in got] == [{"x": i, "y": f"s{i}"} for i in range(3)]
    assert [r.trajectory for r in got] == trajectories


TEXTS = [
    '[{"role": "assistant", "content": "4"}]',  # JSON text of an array: a completion in a JSON format, or a list
    '  {"content": "obj"}',
    "the answer is 4",
    "42",
    '"quoted"',
]


def text_columns(trajectories: list[str], **extra: list[Any]) -> dict[str, list[Any]]:
    n = len(trajectories)
    return {
        "id": [f"t{i}" for i in range(n)],
        "environment": ["arith"] * n,
        "task": [orjson.dumps({"i": i, "deep": {"k": [i]}}).decode() for i in range(n)],
        "trajectory": trajectories,
        **extra,
    }


def test_parquet_text_stays_text_unless_the_file_or_the_caller_says_it_is_json(tmp_path: Path) -> None:
    """A text trajectory reaches the plugin as the text it is, as the same JSON Lines row's would: a string that
    starts with a bracket is not decoded by guess. A text task is decoded: a task can only be an object."""
    path = write_parquet(tmp_path / "in.parquet", text_columns(TEXTS))
    same = write_jsonl(tmp_path / "in.jsonl", [
        {"id": f"t{i}", "environment": "arith", "task": {"i": i, "deep": {"k": [i]}}, "trajectory": text}
        for i, text in enumerate(TEXTS)
    ])
    with open_rows(path) as rows, open_rows(same) as lines:
        got, expected = list(rows), list(lines)
    assert [r.trajectory for r in got] == TEXTS
    assert [(r.id, r.task, r.trajectory) for r in got] == [(r.id, r.task, r.trajectory) for r in expected]

    decoded = [[{"role": "assistant", "content": "4"}], {"content": "obj"}, 42, "quoted"]
    json_texts = [text for text in TEXTS if text != "the answer is 4"]
    listed = write_parquet(tmp_path / "listed.parquet", text_columns(json_texts), json_text="trajectory")
    with open_rows(listed) as rows:  # the file's metadata says so
        assert [r.trajectory for r in rows] == decoded
    flagged = write_parquet(tmp_path / "flagged.parquet", text_columns(json_texts))
    with open_rows(flagged, json_columns={"trajectory"}) as rows:  # the caller says so
        assert [r.trajectory for r in rows] == decoded
    with open_rows(path, json_columns={"trajectory"}) as rows:
        assert [next(rows).trajectory for _ in range(2)] == decoded[:2]
        with pytest.raises(InputError) as info:
            next(rows)  # plain text in a column said to hold JSON text
    assert (info.value.unit, info.value.number) == ("row", 3)
    assert "'trajectory' is text but not valid JSON" in info.value.reason


def test_json_columns_are_task_and_trajectory_only_and_must_be_text(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", text_columns(["a"], ignored=[1]))
    for names in ({"id"}, {"trajectory", "ignored"}, {"verifier"}):
        with pytest.raises(ValueError, match="task and trajectory only"):
            open_rows(path, json_columns=names)
    nested = write_parquet(tmp_path / "nested.parquet", {**text_columns(["a"]), "trajectory": [[1, 2]]})
    with pytest.raises(InputError) as info:
        open_rows(nested, json_columns={"trajectory"})
    assert "--json-columns lists 'trajectory' as JSON text, but the column is list<" in str(info.value)
    tagged = write_parquet(tmp_path / "tagged.parquet", {**text_columns(["a"]), "trajectory": [[1, 2]]},
                           json_text="trajectory")
    with pytest.raises(InputError, match=r"its metadata \(engine.json_columns\) lists 'trajectory'"):
        open_rows(tagged)


def test_a_struct_task_whose_rows_differ_in_keys_is_refused_naming_the_row_and_the_key(tmp_path: Path) -> None:
    """Arrow gives a struct column every key any row has, None where a row has none: a plugin would get keys
    of other rows (or lose a JSON null, were they dropped); a null field is refused, naming row and key."""
    path = write_parquet(tmp_path / "in.parquet", {
        "id": [1, 2, 3],
        "environment": ["arith"] * 3,
        "task": [{"a": 1, "b": {"c": 1}}, {"a": 2, "b": {"c": 2}}, {"a": 3, "b": {"d": "other"}}],
        "trajectory": ["x"] * 3,
    })
    assert pq.read_schema(path).field("task").type.num_fields == 2  # a, and b: struct<c, d>
    with open_rows(path) as rows, pytest.raises(InputError) as info:
        next(rows)  # row 1 has no "d": Arrow gives it b.d = null
    assert (info.value.unit, info.value.number) == ("row", 1)
    assert "task.b.d is null in a struct column" in info.value.reason
    assert "store 'task' as JSON text" in info.value.reason

    messages = write_parquet(tmp_path / "messages.parquet", {
        "id": [1, 2],
        "environment": ["arith"] * 2,
        "task": [{"a": 1}, {"a": 2}],
        "trajectory": [[{"role": "user", "content": "q"}], [{"role": "assistant", "content": "a", "tool": "t"}]],
    })
    with open_rows(messages) as rows, pytest.raises(InputError) as info:
        list(rows)
    assert info.value.number == 1
    assert "trajectory[0].tool is null" in info.value.reason and "pass --json-columns trajectory" in info.value.reason

    same = write_parquet(tmp_path / "same.parquet", {  # every row has every key: read exactly
        "id": [1, 2], "environment": ["arith"] * 2, "task": [{"a": 1, "b": [1]}, {"a": 2, "b": []}],
        "trajectory": [[{"role": "user", "content": "q"}], []],
    })
    with open_rows(same) as rows:
        assert [(r.task, r.trajectory) for r in rows] == [({"a": 1, "b": [1]}, [{"role": "user", "content": "q"}]),
                                                          ({"a": 2, "b": []}, [])]


def test_integers_wider_than_64_bits_are_read_exactly_in_tasks_and_trajectories(tmp_path: Path) -> None:
    wide = [2**64 + 1, -(2**63) - 1, 10**39 + 7]
    base = rows_data(1)[0]
    path = tmp_path / "in.jsonl"
    text = orjson.dumps({**base, "task": {"reference": "W"}, "trajectory": ["T"]})
    path.write_bytes(text.replace(b'"W"', str(wide[0]).encode()).replace(b'"T"', b",".join(
        str(n).encode() for n in wide)) + b"\n")
    with open_rows(path) as rows:
        row = next(rows)
    assert row.task == {"reference": 2**64 + 1} and type(row.task["reference"]) is int
    assert row.trajectory == wide
    parquet = write_parquet(tmp_path / "in.parquet", {
        "id": ["w"], "environment": ["arith"], "task": ['{"reference": 18446744073709551617}'],
        "trajectory": [f"[{wide[1]}, {wide[2]}]"],
    }, json_text="trajectory")
    with open_rows(parquet) as rows:
        row = next(rows)
    assert row.task == {"reference": 2**64 + 1} and type(row.task["reference"]) is int
    assert row.trajectory == wide[1:]


def test_parquet_struct_task_and_text_trajectory_round_trip(tmp_path: Path) -> None:
    data = rows_data(5)
    path = write_nested(tmp_path / "in.parquet", data)
    with open_rows(path) as rows:
        got = list(rows)
    assert [r.trajectory for r in got] == [d["trajectory"] for d in data]
    assert [r.task["i"] for r in got] == list(range(5))


def test_parquet_missing_column_names_it(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {"id": [1], "environment": ["arith"], "trajectory": ["x"]})
    with pytest.raises(InputError) as info:
        open_rows(path)
    assert info.value.number is None
    assert "missing column(s) 'task'" in str(info.value)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("task", "reason"),
    [
        ("{not json", "'task' is text but not valid JSON"),
        ("[1, 2]", "'task' must be an object, got list"),
        (None, "'task' must be an object, got NoneType"),
    ],
)
def test_parquet_bad_task_names_its_row(tmp_path: Path, task: Any, reason: str) -> None:
    path = write_parquet(
        tmp_path / "in.parquet",
        {
            "id": [1, 2, 3],
            "environment": ["arith"] * 3,
            "task": ['{"a": 1}', task, '{"a": 3}'],
            "trajectory": ["x"] * 3,
        },
    )
    with open_rows(path) as rows:
        assert next(rows).task == {"a": 1}
        with pytest.raises(InputError) as info:
            next(rows)
    assert (info.value.unit, info.value.number) == ("row", 2)
    assert reason in str(info.value)
    assert str(info.value).startswith(f"{path}: row 2: ")


def test_parquet_null_environment_names_its_row(tmp_path: Path) -> None:
    path = write_parquet(
        tmp_path / "in.parquet",
        {"id": [1, 2], "environment": ["arith", None], "task": ["{}", "{}"], "trajectory": ["x", "y"]},
    )
    with open_rows(path) as rows, pytest.raises(InputError, match=r"row 2: 'environment' must be"):
        list(rows)


def test_parquet_value_json_cannot_represent(tmp_path: Path) -> None:
    path = write_parquet(
        tmp_path / "in.parquet",
        {"id": [b"ok?", b"no"], "environment": ["arith"] * 2, "task": ["{}"] * 2, "trajectory": ["x"] * 2},
    )
    with pytest.raises(InputError) as info:
        list(open_rows(path))
    assert (info.value.unit, info.value.number) == ("row", 1)
    assert "JSON cannot represent" in str(info.value)


def test_not_parquet(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    path.write_bytes(b"this is not parquet at all")
    with pytest.raises(InputError, match="cannot read as Parquet"):
        open_rows(path)


def test_parquet_across_batches_and_row_groups(tmp_path: Path) -> None:
    n = BATCH_ROWS * 2 + 37
    data = rows_data(n)
    path = write_nested(tmp_path / "in.parquet", data, row_group_size=700)
    with open_rows(path, start=BATCH_ROWS + 5) as rows:
        assert rows.rows_read == BATCH_ROWS + 5
        got = list(rows)
        assert rows.rows_read == n
    assert [r.number for r in got] == list(range(BATCH_ROWS + 6, n + 1))
    assert [r.id for r in got] == [d["id"] for d in data[BATCH_ROWS + 5 :]]


# --- files and extensions ---------------------------------------------------------------------


def test_unsupported_extension_names_the_supported_ones(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_text("id,environment\n")
    with pytest.raises(InputError) as info:
        open_rows(path)
    message = str(info.value)
    assert "'.csv'" in message
    assert all(s in message for s in (".jsonl", ".ndjson", ".json-lines", ".parquet"))


@pytest.mark.parametrize("name", ["missing.jsonl", "missing.parquet"])
def test_missing_file_is_an_input_error(tmp_path: Path, name: str) -> None:
    with pytest.raises(InputError, match="cannot read"):
        open_rows(tmp_path / name)


def test_bad_start(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", rows_data(1))
    with pytest.raises(ValueError, match="start"):
        open_rows(path, start=-1)


# --- skip and checksum ------------------------------------------------------------------------


def test_start_skips_and_numbers_stay_right(tmp_path: Path) -> None:
    data = rows_data(10)
    path = write_jsonl(tmp_path / "in.jsonl", data, blank_every=4)
    with open_rows(path) as rows:
        everything = list(rows)
    with open_rows(path, start=6) as rows:
        assert rows.rows_read == 6
        rest = list(rows)
    assert rest == everything[6:]


def test_skipped_rows_are_not_validated(tmp_path: Path) -> None:
    # a resumed run validated them the first time; skipping only counts and hashes them
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"not json\n" + orjson.dumps(rows_data(1)[0]) + b"\n")
    with open_rows(path, start=1) as rows:
        assert [r.number for r in rows] == [2]


def test_start_past_the_end_reports_how_many_rows_there_were(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", rows_data(3), blank_every=2)
    with open_rows(path, start=10) as rows:
        assert rows.rows_read == 3
        assert list(rows) == []


def prefix_through_line(path: Path, line: int) -> bytes:
    """The file's bytes up to and including line ``line`` (1-based)."""
    data = path.read_bytes()
    end = 0
    for _ in range(line):
        end = data.index(b"\n", end) + 1
    return data[:end]


def test_jsonl_checksum_is_sha256_of_what_was_read(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", rows_data(6), blank_every=2)
    with open_rows(path) as rows:
        assert rows.checksum() == EMPTY_CHECKSUM
        seen = [next(rows) for _ in range(4)]
        expected = "sha256:" + hashlib.sha256(prefix_through_line(path, seen[-1].number)).hexdigest()
        assert rows.checksum() == expected
    with open_rows(path, start=4) as skipped:
        assert skipped.checksum() == expected


def checksums(path: Path, n: int) -> list[str]:
    """The reader's checksum after each of the first ``n`` rows."""
    out = []
    with open_rows(path) as rows:
        for _ in range(n):
            next(rows)
            out.append(rows.checksum())
    return out


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_checksum_is_stable_and_changes_with_a_read_row(tmp_path: Path, fmt: str) -> None:
    data = rows_data(8)

    def write(name: str, rows: list[dict[str, Any]], row_group_size: int | None = None) -> Path:
        if fmt == "jsonl":
            return write_jsonl(tmp_path / f"{name}.jsonl", rows)
        return write_nested(tmp_path / f"{name}.parquet", rows, row_group_size=row_group_size)

    original = write("a", data)
    first = checksums(original, 8)
    assert len(set(first)) == 8  # each row moves it
    assert checksums(original, 8) == first  # and it is deterministic
    with open_rows(original, start=5) as rows:
        assert rows.checksum() == first[4]

    changed = [dict(d) for d in data]
    changed[3]["trajectory"] = "a different answer"
    second = checksums(write("b", changed), 8)
    assert second[:3] == first[:3]  # rows before the change read the same
    assert all(a != b for a, b in zip(first[3:], second[3:], strict=True))  # from it on, never

    later = [dict(d) for d in data]
    later[7]["task"] = {"i": 7, "other": True}
    assert checksums(write("c", later), 7) == first[:7]  # a change after row 7 leaves rows 1..7 alone

    if fmt == "parquet":  # values, not bytes: a differently laid-out file of the same rows hashes alike
        assert checksums(write("d", data, row_group_size=3), 8) == first


TAILS = {  # what may follow the last row of a JSON Lines file
    "blank lines": b"\n\n",
    "whitespace-only lines": b"  \n\t\r\n   ",
    "no final newline": None,
}


@pytest.mark.parametrize("tail", TAILS, ids=list(TAILS))
@pytest.mark.parametrize("chunk", [2, 3, 5])
def test_reading_past_the_last_row_leaves_the_checksum_a_resume_gets(tmp_path: Path, tail: str, chunk: int) -> None:
    """The last short chunk reads to the end of the file: what it checkpoints, skipping those rows must give."""
    path = write_jsonl(tmp_path / "in.jsonl", rows_data(5))
    ending = TAILS[tail]
    path.write_bytes(path.read_bytes()[:-1] if ending is None else path.read_bytes() + ending)
    with open_rows(path) as rows:
        checkpoints = []
        while list(islice(rows, chunk)):  # as engine._backfill.run reads it
            checkpoints.append((rows.rows_read, rows.checksum()))
    assert checkpoints[-1][0] == 5
    for done, checksum in checkpoints:
        with open_rows(path, start=done) as skipped:
            assert (skipped.rows_read, skipped.checksum()) == (done, checksum)
    data = path.read_bytes()
    end = data.rindex(b"}") + 1  # the end of the last row's line, its newline included if it has one
    end += data[end : end + 1] == b"\n"
    assert checkpoints[-1][1] == "sha256:" + hashlib.sha256(data[:end]).hexdigest()


def test_an_integer_id_orjson_cannot_keep_exact_is_refused_by_its_line(tmp_path: Path) -> None:
    """orjson reads -2**63 .. 2**64 - 1 exactly and a wider integer as a float: two ids would become one."""
    exact = [2**63 - 1, 2**63, 2**64 - 1, -(2**63), 1.5e29, 12.0]  # the floats were written as floats
    base = rows_data(1)[0]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps({**base, "id": value}) + b"\n" for value in exact))
    with open_rows(path) as rows:
        read = [row.id for row in rows]
    assert read == exact and [type(v) for v in read] == [type(v) for v in exact]

    for wide in (2**64, -(2**63) - 1, 123456789012345678901234567890):
        line = orjson.dumps({**base, "id": "X"}).replace(b'"X"', str(wide).encode())
        path.write_bytes(orjson.dumps(base) + b"\n\n" + line + b"\n")
        with open_rows(path) as rows, pytest.raises(InputError) as info:
            list(rows)
        assert (info.value.unit, info.value.number) == ("line", 3)
        assert "an integer id must fit in 64 bits; write it as a string" in str(info.value)
        assert str(wide)[:15] in str(info.value)


def test_an_id_holding_an_integer_orjson_cannot_keep_exact_is_refused_by_its_line(tmp_path: Path) -> None:
    """The same inside a list or an object: [10**23 + 1] and [10**23] would be one id."""
    base = rows_data(1)[0]
    path = tmp_path / "in.jsonl"
    kept = [[1.5, 2**63], {"a": [0.25]}]  # floats written as floats, integers orjson keeps
    path.write_bytes(b"".join(orjson.dumps({**base, "id": value}) + b"\n" for value in kept))
    with open_rows(path) as rows:
        assert [row.id for row in rows] == kept
    for wide in ("[100000000000000000000001]", '{"run": [1, 100000000000000000000001]}'):
        line = orjson.dumps({**base, "id": "X"}).replace(b'"X"', wide.encode())
        path.write_bytes(line + b"\n")
        with open_rows(path) as rows, pytest.raises(InputError) as info:
            list(rows)
        assert (info.value.unit, info.value.number) == ("line", 1)
        assert "an integer in an id must fit in 64 bits; write it as a string" in str(info.value)


# --- the decoder on its own (what the Ray actors and datasets read their rows with) ----------------------


class Environments:
    """An engine's environments, as far as a check of rows needs them: ``known`` exist, ``broken``'s manifest is."""

    def __init__(self, *known: str, broken: str = "") -> None:
        self.known, self.broken = set(known), broken

    def environment(self, name: str) -> object:
        if name == self.broken:
            raise ManifestError(f"{name}/manifest.json: not JSON")
        if name not in self.known:
            raise ValueError(f"unknown environment {name!r}")
        return name


def test_the_decoder_reads_parquet_rows_as_the_reader_does_and_refuses_the_same_bad_ones(tmp_path: Path) -> None:
    columns = nested_columns(rows_data(4))
    columns["task"][2] = {"i": 2, "label": None}  # a struct field null in one row: refused, by its row
    path = write_parquet(tmp_path / "in.parquet", columns, json_text="trajectory")
    with open_rows(path) as rows:
        read = [next(rows), next(rows)]
        with pytest.raises(InputError) as by_reader:
            next(rows)
    decoder = RowDecoder(path)
    decoder.use_schema(pq.ParquetFile(path).schema_arrow)
    stored = list(zip(*(columns[name] for name in ("id", "environment", "task", "trajectory")), strict=True))
    assert [decoder.decode(n, values) for n, values in enumerate(stored[:2], 1)] == read
    with pytest.raises(InputError) as by_decoder:
        decoder.decode(3, stored[2])
    assert str(by_decoder.value) == str(by_reader.value)
    assert (by_decoder.value.path, by_decoder.value.unit, by_decoder.value.number) == (path, "row", 3)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b"\xff\xfe not utf-8\n", "invalid UTF-8 at byte 1"),
        (b'{"id": 1, "environment": "", "task": {}, "trajectory": 1}\n', "'environment' must be"),
        (b'{"id": 1e999, "environment": "arith", "task": {}, "trajectory": 1}\n', "invalid JSON"),
        (b"[" * 100_000 + b"\n", "invalid JSON"),
    ],
)
def test_the_decoder_refuses_a_hostile_line_naming_it(tmp_path: Path, line: bytes, reason: str) -> None:
    decoder = RowDecoder(tmp_path / "in.jsonl")  # never opened: the line is handed to it
    with pytest.raises(InputError) as info:
        decoder.decode(7, line)
    assert (info.value.unit, info.value.number) == ("line", 7)
    assert reason in str(info.value)


def test_the_decoder_checks_rows_environments_against_the_engine(tmp_path: Path) -> None:
    decoder = RowDecoder(tmp_path / "in.jsonl")
    rows = [decoder.decode(n, orjson.dumps({**row, "environment": name}))
            for n, (row, name) in enumerate(zip(rows_data(3), ["arith", "nope", "other"], strict=True), 4)]
    decoder.check_environments(rows[:1], Environments("arith"))
    with pytest.raises(InputError) as info:
        decoder.check_environments(rows, Environments("arith", "other"))
    assert (info.value.unit, info.value.number) == ("line", 5) and "unknown environment 'nope'" in str(info.value)
    with pytest.raises(ManifestError):  # a broken manifest is the config's error, not the row's
        decoder.check_environments(rows, Environments("arith", broken="nope"))


def test_a_decoder_refuses_an_unknown_format_and_unknown_json_columns(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="supported"):
        RowDecoder(tmp_path / "in.csv")
    with pytest.raises(ValueError, match="JSON text columns can be task and trajectory only"):
        RowDecoder(tmp_path / "in.parquet", ["id"])
