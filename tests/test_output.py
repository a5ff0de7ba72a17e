"""engine._backfill.{writer,checkpoint,parquet,ids} and run.open_run: atomic reward files, checkpoints, and resume
after a crash, a failure or kill -9."""

from __future__ import annotations

import hashlib
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from cli_support import (
    ForkedRun,
    child_env,
    finish_steps,
    fork_under_trace,
    kill_forked_at_step,
    start_under_trace,
)

from engine import InputError, OutputError, ResumeError, RewardRecord, VerificationError, read_rewards
from engine._backfill.checkpoint import STATE_FORMAT, Checkpoint, lock_path, state_path
from engine._backfill.files import EMPTY_CHECKSUM
from engine._backfill.input import FIELDS, Row, open_rows
from engine._backfill.run import open_run
from engine._backfill.writer import open_output, partial_path

VERIFIER = {"kind": "plugin", "ref": "verify:score", "environment": "arith", "digest": "sha256:" + "ab" * 32}
RUBRIC = {"kind": "rubric", "ref": "alice/arith@3", "version": 3, "digest": "sha256:" + "cd" * 32, "environment": "x"}
ENDPOINT = {"kind": "endpoint", "ref": "http://127.0.0.1:1/score", "environment": "remote"}
FORMATS = ["jsonl", "parquet"]


def write_input(path: Path, n: int, *, changed: dict[int, str] | None = None) -> Path:
    """``n`` JSON Lines rows; ``changed`` maps a 0-based row to a different trajectory."""
    changed = changed or {}
    with path.open("wb") as f:
        for i in range(n):
            row = {"id": f"row-{i}", "environment": "arith", "task": {"i": i}, "trajectory": changed.get(i, f"t{i}")}
            f.write(orjson.dumps(row) + b"\n")
    return path


def reward_of(row: Row) -> float:
    """A deterministic stand-in for a verifier: depends on the task and the trajectory."""
    return float(row.task["i"] / 7 + len(str(row.trajectory)) / 1000)


def write_chunk(writer: Any, batch: list[Row]) -> None:
    for row in batch:
        writer.write(row.id, reward_of(row), VERIFIER if row.task["i"] % 3 else RUBRIC)


def score_all(input_path: Path, output: Path, *, resume: bool = False, chunk: int = 3) -> int:
    """Score every row, checkpointing each chunk, and finish; returns how many rows this run scored."""
    scored = 0
    with open_run(input_path, output, resume=resume) as (rows, writer):
        while batch := list(islice(rows, chunk)):
            write_chunk(writer, batch)
            scored += len(batch)
            writer.checkpoint(rows.rows_read, rows.checksum())
        writer.finish()
    return scored


def interrupted(input_path: Path, output: Path, *, chunks: int, chunk: int = 3) -> None:
    """Score ``chunks`` chunks with checkpoints, then half of the next one, and stop without finishing."""
    with open_run(input_path, output) as (rows, writer):
        for _ in range(chunks):
            write_chunk(writer, list(islice(rows, chunk)))
            writer.checkpoint(rows.rows_read, rows.checksum())
        write_chunk(writer, list(islice(rows, chunk // 2 + 1)))


def state_of(output: Path) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads(state_path(output).read_bytes())
    return data


@pytest.fixture(params=FORMATS)
def fmt(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def reference(tmp_path: Path, fmt: str) -> Path:
    """The output of an uninterrupted run over the 20-row input ``in.jsonl``."""
    out = tmp_path / "ref" / f"rewards.{fmt}"
    out.parent.mkdir()
    score_all(write_input(tmp_path / "in.jsonl", 20), out)
    return out


# --- round trips ------------------------------------------------------------------------------

ID_SETS: dict[str, list[Any]] = {
    "ints": [1, 2, 3, -4],
    "strings": ["a", "b", "", "ü"],
    "ints and nulls": [None, 1, None, 2],
    "all null": [None, None],
    "mixed": [1, "1", None, {"k": [1]}, 2**64 - 1, True, 1.5],
}


@pytest.mark.parametrize("ids", ID_SETS.values(), ids=ID_SETS.keys())
def test_round_trip(tmp_path: Path, fmt: str, ids: list[Any]) -> None:
    inp = write_input(tmp_path / "in.jsonl", 1)
    out = tmp_path / f"rewards.{fmt}"
    records = [RewardRecord(i, k / 3 - 1, VERIFIER if k % 2 else RUBRIC) for k, i in enumerate(ids)]
    with open_output(out, input_path=inp, resume=False) as writer:
        for r in records:
            writer.write(r.id, r.reward, r.verifier)
        writer.finish()
    got = list(read_rewards(out))
    assert got == records
    assert [type(g.id) for g in got] == [type(r.id) for r in records]  # 1 stays 1, "1" stays "1", True stays True


# The verifier column's type, as the README documents it: one struct for every kind, every field nullable.
VERIFIER_STRUCT = pa.struct(
    [("kind", pa.string()), ("ref", pa.string()), ("environment", pa.string()), ("digest", pa.string()),
     ("version", pa.int64()), ("prompt", pa.int64()), ("model", pa.string()),
     ("judge", pa.struct([("model", pa.string()), ("base_url", pa.string()), ("temperature", pa.float64()),
                          ("max_tokens", pa.int64()), ("response_format", pa.bool_())])),
     ("cached", pa.float64())]
)  # fmt: skip


RUBRIC_ONLY = {"prompt": None, "model": None, "judge": None, "cached": None}  # a rubric's fields, null for the rest


@pytest.mark.parametrize(
    ("ids", "id_type", "json_columns"),
    [
        ([1, None, 2], pa.int64(), b""),
        (["a", None], pa.string(), b""),
        ([None], pa.string(), b""),
        ([1, "a"], pa.string(), b"id"),
    ],
)
def test_parquet_columns(tmp_path: Path, ids: list[Any], id_type: pa.DataType, json_columns: bytes) -> None:
    inp = write_input(tmp_path / "in.jsonl", 1)
    out = tmp_path / "rewards.parquet"
    with open_output(out, input_path=inp, resume=False) as writer:
        for i in ids:
            writer.write(i, 0.5, VERIFIER)
        writer.finish()
    schema = pq.read_schema(out)
    assert schema.names == ["id", "reward", "verifier"]
    assert schema.field("id").type == id_type
    assert schema.field("reward").type == pa.float64()
    assert schema.field("verifier").type == VERIFIER_STRUCT
    assert all(field.nullable for field in VERIFIER_STRUCT) and not schema.field("verifier").nullable
    assert schema.metadata[b"engine.json_columns"] == json_columns
    assert pq.read_table(out).column("verifier")[0].as_py() == {**VERIFIER, "version": None, **RUBRIC_ONLY}


def test_parquet_verifier_is_a_struct_for_every_kind(tmp_path: Path) -> None:
    """A file mixing the three kinds: one struct type, each kind's fields set and the others null, queryable
    without parsing JSON, and read back as written."""
    inp, out = write_input(tmp_path / "in.jsonl", 1), tmp_path / "rewards.parquet"
    kinds = [VERIFIER, ENDPOINT, RUBRIC] * 2
    records = [RewardRecord(f"row-{k}", k / 10, verifier) for k, verifier in enumerate(kinds)]
    with open_output(out, input_path=inp, resume=False) as writer:
        for r in records:
            writer.write(r.id, r.reward, r.verifier)
        writer.finish()
    verifier = pq.read_table(out).column("verifier").combine_chunks()
    assert verifier.type == VERIFIER_STRUCT
    assert verifier.field("kind").to_pylist() == ["plugin", "endpoint", "rubric"] * 2
    assert verifier.field("ref").to_pylist() == [VERIFIER["ref"], ENDPOINT["ref"], RUBRIC["ref"]] * 2
    assert verifier.field("environment").to_pylist() == ["arith", "remote", "x"] * 2
    assert verifier.field("digest").to_pylist() == [VERIFIER["digest"], None, RUBRIC["digest"]] * 2
    assert verifier.field("version").to_pylist() == [None, None, 3] * 2
    rubric_rows = pq.read_table(out, filters=pc.field("verifier", "kind") == "rubric")  # a query on a nested field
    assert rubric_rows.column("reward").to_pylist() == [0.2, 0.5]
    assert list(read_rewards(out)) == records  # null fields are left out: each kind reads back its own keys


@pytest.mark.parametrize(
    ("verifier", "problem"),
    [
        ({**RUBRIC, "rubric_version": 3}, "a key 'rubric_version'"),
        ({**RUBRIC, "version": "3"}, "'version' must be a 64-bit integer"),
        ({**RUBRIC, "version": True}, "'version' must be a 64-bit integer"),
        ({**RUBRIC, "version": 2**63}, "'version' must be a 64-bit integer"),
        ({**VERIFIER, "digest": 5}, "'digest' must be a string"),
    ],
)
def test_a_verifier_the_parquet_struct_cannot_hold_is_refused_when_written(
    tmp_path: Path, verifier: dict[str, Any], problem: str
) -> None:
    """Not dropped or failed at the end: refused before it is written. JSON Lines writes it as given."""
    inp = write_input(tmp_path / "in.jsonl", 1)
    with open_output(tmp_path / "rewards.parquet", input_path=inp, resume=False) as writer:
        with pytest.raises(TypeError, match=f"verifier of id 'x' cannot be written to Parquet: .*{problem}"):
            writer.write("x", 0.5, verifier)
        assert writer.rows_written == 0 and partial_path(writer.output).read_bytes() == b""
    with open_output(tmp_path / "rewards.jsonl", input_path=inp, resume=False) as writer:
        writer.write("x", 0.5, verifier)
        writer.finish()
    assert list(read_rewards(tmp_path / "rewards.jsonl")) == [RewardRecord("x", 0.5, verifier)]


@pytest.mark.parametrize(
    ("ids", "id_type", "json_id"),
    [
        ([1, None, 2], pa.int64(), False),
        (["a", None], pa.string(), False),
        ([1, "a", None, {"k": [1]}], pa.string(), True),
    ],
    ids=["int", "str", "json"],
)
def test_a_parquet_output_of_the_previous_version_reads_back(
    tmp_path: Path, ids: list[Any], id_type: pa.DataType, json_id: bool
) -> None:
    """Written before the struct: ``verifier`` as JSON text, listed with a JSON ``id`` in ``engine.json_columns``."""
    records = [RewardRecord(i, k / 4, [VERIFIER, ENDPOINT, RUBRIC][k % 3]) for k, i in enumerate(ids)]
    table = pa.table(
        {
            "id": pa.array([orjson.dumps(i).decode() if json_id and i is not None else i for i in ids], id_type),
            "reward": pa.array([r.reward for r in records], pa.float64()),
            "verifier": pa.array([orjson.dumps(r.verifier).decode() for r in records], pa.string()),
        }
    ).replace_schema_metadata({b"engine.json_columns": b"id,verifier" if json_id else b"verifier"})
    out = tmp_path / "old.parquet"
    pq.write_table(table, out)
    assert list(read_rewards(out)) == records


def left_by_the_previous_version(inp: Path, out: Path, verifiers: list[dict[str, Any]]) -> None:
    """An interrupted run's partial file and state as the version that wrote ``verifier`` as JSON text left them:
    the records of the first ``len(verifiers)`` rows, checkpointed (the spool's format is the same in both)."""
    with open_rows(inp) as rows:
        done = list(islice(rows, len(verifiers)))
        input_checksum = rows.checksum()
    lines = b"".join(
        orjson.dumps({"id": row.id, "reward": reward_of(row), "verifier": verifier}) + b"\n"
        for row, verifier in zip(done, verifiers, strict=True)
    )
    partial_path(out).write_bytes(lines)
    Checkpoint(
        input=str(inp.resolve()),
        rows_done=len(done),
        input_checksum=input_checksum,
        output_bytes=len(lines),
        output_checksum="sha256:" + hashlib.sha256(lines).hexdigest(),
    ).save(state_path(out))


@pytest.mark.parametrize("fmt", ["parquet"])  # the reference output is Parquet
def test_a_partial_parquet_run_of_the_previous_version_resumes_to_a_struct_column(
    tmp_path: Path, reference: Path
) -> None:
    """The previous version's partial file is JSON Lines, as this one's: the resumed run writes the new schema."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "rewards.parquet"
    left_by_the_previous_version(inp, out, [VERIFIER if i % 3 else RUBRIC for i in range(6)])
    assert score_all(inp, out, resume=True) == 14
    assert pq.read_schema(out).field("verifier").type == VERIFIER_STRUCT
    assert out.read_bytes() == reference.read_bytes()  # as an uninterrupted run of this version writes it


def test_a_partial_parquet_run_whose_verifier_the_struct_cannot_hold_is_refused_on_resume(tmp_path: Path) -> None:
    """The previous version took any keys: such a run is refused at once, not after scoring the rest."""
    inp, out = write_input(tmp_path / "in.jsonl", 10), tmp_path / "rewards.parquet"
    old_rubric = {"kind": "rubric", "ref": "alice/arith", "environment": "judge", "rubric_version": 3}
    left_by_the_previous_version(inp, out, [VERIFIER, VERIFIER, old_rubric, VERIFIER])
    before = partial_path(out).read_bytes(), state_path(out).read_bytes()
    expected = r"rewards\.parquet\.partial, line 3: .* a key 'rubric_version'.*delete .*rewards\.parquet\.state\.json"
    with pytest.raises(ResumeError, match=expected), open_run(inp, out, resume=True):
        pass
    assert (partial_path(out).read_bytes(), state_path(out).read_bytes()) == before  # refused, not damaged


def test_jsonl_output_is_one_object_a_line_in_input_order(tmp_path: Path) -> None:
    inp = write_input(tmp_path / "in.jsonl", 5)
    out = tmp_path / "rewards.jsonl"
    score_all(inp, out, chunk=2)
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [line["id"] for line in lines] == [f"row-{i}" for i in range(5)]
    assert all(list(line) == ["id", "reward", "verifier"] for line in lines)
    with open_rows(inp) as rows:
        assert [line["reward"] for line in lines] == [reward_of(r) for r in rows]


@pytest.mark.timeout(30)
def test_parquet_output_spans_row_groups(tmp_path: Path) -> None:
    inp = write_input(tmp_path / "in.jsonl", 1)
    out = tmp_path / "rewards.parquet"
    n = 70_000  # more than one batch of the spool conversion
    with open_output(out, input_path=inp, resume=False) as writer:
        for i in range(n):
            writer.write(i, i / n, VERIFIER)
        writer.finish()
    assert pq.ParquetFile(out).metadata.num_row_groups >= 2
    got = list(read_rewards(out))
    assert [g.id for g in got] == list(range(n))
    assert got[-1] == RewardRecord(n - 1, (n - 1) / n, VERIFIER)


# --- never half-written -----------------------------------------------------------------------


def test_output_appears_only_at_finish(tmp_path: Path, fmt: str) -> None:
    inp = write_input(tmp_path / "in.jsonl", 6)
    out = tmp_path / f"rewards.{fmt}"
    with open_run(inp, out) as (rows, writer):
        write_chunk(writer, list(rows))
        writer.checkpoint(rows.rows_read, rows.checksum())
        assert not out.exists()
        assert partial_path(out).exists() and state_path(out).exists()
        writer.finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["in.jsonl", out.name])
    assert len(list(read_rewards(out))) == 6


def test_old_complete_output_is_replaced_only_at_finish(tmp_path: Path, fmt: str) -> None:
    inp = write_input(tmp_path / "in.jsonl", 4)
    out = tmp_path / f"rewards.{fmt}"
    score_all(write_input(tmp_path / "old.jsonl", 2), out)
    old = out.read_bytes()
    with open_run(inp, out) as (rows, writer):
        write_chunk(writer, list(rows))
        writer.checkpoint(rows.rows_read, rows.checksum())
        assert out.read_bytes() == old
        writer.finish()
    assert [r.id for r in read_rewards(out)] == [f"row-{i}" for i in range(4)]


def test_a_failure_keeps_everything_checkpointed_and_resumes(tmp_path: Path, fmt: str, reference: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / f"rewards.{fmt}"
    with pytest.raises(VerificationError), open_run(inp, out) as (rows, writer):
        while batch := list(islice(rows, 3)):
            if any(row.task["i"] == 13 for row in batch):
                raise VerificationError("plugin", "verify:score", "boom", index=13)
            write_chunk(writer, batch)
            writer.checkpoint(rows.rows_read, rows.checksum())
    assert not out.exists()
    assert state_of(out)["rows_done"] == 12
    assert [r.id for r in read_rewards_partial(out)] == [f"row-{i}" for i in range(12)]
    assert score_all(inp, out, resume=True) == 8
    assert out.read_bytes() == reference.read_bytes()


def read_rewards_partial(output: Path) -> Iterator[RewardRecord]:
    """The records in a run's partial file (JSON Lines whatever the output's format)."""
    spool = output.with_name("spool.jsonl")
    spool.write_bytes(partial_path(output).read_bytes())
    return read_rewards(spool)


# --- checkpoint and resume --------------------------------------------------------------------


def test_crash_after_a_checkpoint_resumes_to_an_identical_file(tmp_path: Path, fmt: str, reference: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / f"rewards.{fmt}"
    interrupted(inp, out, chunks=2)
    with partial_path(out).open("ab") as f:
        f.write(b'{"id": "row-8", "reward": 0.1, "verif')  # a record cut off by the crash
    checkpointed = state_of(out)["output_bytes"]
    assert partial_path(out).stat().st_size > checkpointed  # records after the checkpoint are on disk

    with open_run(inp, out, resume=True) as (rows, writer):
        assert writer.rows_written == 6
        assert partial_path(out).stat().st_size == checkpointed  # truncated back to the checkpoint
        rest = list(rows)
        assert [r.number for r in rest] == list(range(7, 21))
        write_chunk(writer, rest)
        writer.checkpoint(rows.rows_read, rows.checksum())
        writer.finish()
    assert out.read_bytes() == reference.read_bytes()
    assert not partial_path(out).exists() and not state_path(out).exists()


def test_resume_after_the_last_checkpoint_but_before_finish(tmp_path: Path, fmt: str, reference: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / f"rewards.{fmt}"
    with open_run(inp, out) as (rows, writer):
        write_chunk(writer, list(rows))
        writer.checkpoint(rows.rows_read, rows.checksum())
    assert score_all(inp, out, resume=True) == 0
    assert out.read_bytes() == reference.read_bytes()


def test_resume_right_after_start(tmp_path: Path, fmt: str, reference: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / f"rewards.{fmt}"
    open_output(out, input_path=inp, resume=False).close()
    assert state_of(out)["rows_done"] == 0
    assert score_all(inp, out, resume=True) == 20
    assert out.read_bytes() == reference.read_bytes()


def test_state_records_the_checkpoint(tmp_path: Path) -> None:
    inp, out = write_input(tmp_path / "in.jsonl", 10), tmp_path / "rewards.jsonl"
    with open_run(inp, out) as (rows, writer):
        assert state_of(out)["input_checksum"] == EMPTY_CHECKSUM
        write_chunk(writer, list(islice(rows, 4)))
        writer.checkpoint(4, rows.checksum(), meta={"verifiers": {"verify:score": {"items": 4}}})
        state = state_of(out)
        assert state["format"] == STATE_FORMAT
        assert state["input"] == str(inp.resolve())
        assert state["rows_done"] == 4
        assert state["input_checksum"] == rows.checksum()
        assert state["output_bytes"] == partial_path(out).stat().st_size
    with open_run(inp, out, resume=True) as (rows, writer):
        assert writer.last_checkpoint.meta == {"verifiers": {"verify:score": {"items": 4}}}
        write_chunk(writer, [next(rows)])
        writer.checkpoint(5, rows.checksum())  # meta carries over when not given
        assert state_of(out)["meta"] == {"verifiers": {"verify:score": {"items": 4}}}


def test_fresh_run_refused_while_an_interrupted_run_exists(tmp_path: Path) -> None:
    inp, out = write_input(tmp_path / "in.jsonl", 10), tmp_path / "rewards.jsonl"
    interrupted(inp, out, chunks=1)
    before = partial_path(out).read_bytes(), state_path(out).read_bytes()
    with pytest.raises(ResumeError) as info, open_run(inp, out):
        pass
    assert "--resume" in str(info.value) and str(state_path(out)) in str(info.value)
    assert (partial_path(out).read_bytes(), state_path(out).read_bytes()) == before


def test_a_second_run_for_the_same_output_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    inp, out = write_input(tmp_path / "in.jsonl", 10), tmp_path / "rewards.jsonl"
    with open_run(inp, out) as (rows, writer):
        for row in islice(rows, 4):
            writer.write(row.id, reward_of(row), VERIFIER)
        writer.checkpoint(4, rows.checksum())
        before = partial_path(out).read_bytes(), state_path(out).read_bytes()
        for resume in (False, True):
            with pytest.raises(OutputError) as info, open_run(inp, out, resume=resume):
                pass
            assert f"being written by another run (pid {os.getpid()}" in str(info.value)
        assert (partial_path(out).read_bytes(), state_path(out).read_bytes()) == before
        for row in rows:
            writer.write(row.id, reward_of(row), VERIFIER)
        writer.checkpoint(10, rows.checksum())
        writer.finish()
    assert not lock_path(out).exists()
    assert [record.id for record in read_rewards(out)] == [f"row-{i}" for i in range(10)]
    with open_run(inp, tmp_path / "again.jsonl"), open_run(inp, out):  # another output, another lock; this one free
        pass


def test_resume_refused_without_state(tmp_path: Path) -> None:
    inp, out = write_input(tmp_path / "in.jsonl", 3), tmp_path / "rewards.jsonl"
    with pytest.raises(ResumeError, match="run without --resume"), open_run(inp, out, resume=True):
        pass


def test_resume_refused_for_another_input(tmp_path: Path) -> None:
    inp, out = write_input(tmp_path / "in.jsonl", 10), tmp_path / "rewards.jsonl"
    other = write_input(tmp_path / "other.jsonl", 10)
    interrupted(inp, out, chunks=1)
    with pytest.raises(ResumeError, match=r"read .*in\.jsonl, not .*other\.jsonl"), open_run(other, out, resume=True):
        pass


def test_resume_refused_when_a_read_row_changed(tmp_path: Path) -> None:
    inp, out = write_input(tmp_path / "in.jsonl", 10), tmp_path / "rewards.jsonl"
    interrupted(inp, out, chunks=2)
    write_input(inp, 10, changed={4: "edited"})
    changed = "the input changed since the run started: the first 6 rows"
    with pytest.raises(ResumeError, match=changed), open_run(inp, out, resume=True):
        pass
    assert state_of(out)["rows_done"] == 6  # refused, not damaged


def test_resume_refused_when_the_input_shrank(tmp_path: Path) -> None:
    inp, out = write_input(tmp_path / "in.jsonl", 10), tmp_path / "rewards.jsonl"
    interrupted(inp, out, chunks=2)
    write_input(inp, 4)
    with pytest.raises(ResumeError, match="now has 4 rows, but 6 were already scored"), open_run(inp, out, resume=True):
        pass


def test_resume_accepts_changes_after_the_rows_done(tmp_path: Path) -> None:
    inp, out = write_input(tmp_path / "in.jsonl", 10), tmp_path / "rewards.jsonl"
    interrupted(inp, out, chunks=2)
    write_input(inp, 12, changed={8: "edited later"})
    assert score_all(inp, out, resume=True) == 6
    with open_rows(inp) as rows:
        assert [r.reward for r in read_rewards(out)] == [reward_of(row) for row in rows]


@pytest.mark.parametrize("damage", ["flip", "shorten", "delete"])
def test_resume_refused_when_the_partial_file_changed(tmp_path: Path, damage: str) -> None:
    inp, out = write_input(tmp_path / "in.jsonl", 10), tmp_path / "rewards.jsonl"
    interrupted(inp, out, chunks=2)
    partial = partial_path(out)
    data = partial.read_bytes()
    if damage == "flip":
        partial.write_bytes(data[:5] + bytes([data[5] ^ 1]) + data[6:])
        expected = "no longer holds what was checkpointed"
    elif damage == "shorten":
        partial.write_bytes(data[:10])
        expected = "holds 10 bytes but"
    else:
        partial.unlink()
        expected = "is missing"
    with pytest.raises(ResumeError, match=expected), open_run(inp, out, resume=True):
        pass


def edited_state(**changes: Any) -> bytes:
    """A state file as a run writes it, with ``changes`` (``finished__KEY`` for a key of the finished record)."""
    checksum = "sha256:" + "0" * 64
    finished = {"output_bytes": 10, "output_checksum": checksum, "repeated_ids": 0, "ids_repeated": 0}
    state = {"format": STATE_FORMAT, "input": "x", "rows_done": 3, "input_checksum": checksum,
             "output_bytes": 10, "output_checksum": checksum, "meta": {}, "finished": finished}  # fmt: skip
    for key, value in changes.items():
        if key.startswith("finished__"):
            finished[key.removeprefix("finished__")] = value
        else:
            state[key] = value
    return orjson.dumps(state)


EDITED_STATES = [  # hand-edited states the loader must refuse, not half-trust
    edited_state(output_bytes=-5),
    edited_state(rows_done=-1),
    edited_state(output_checksum="sha256:abc"),
    edited_state(input_checksum="md5:" + "0" * 64),
    edited_state(finished__output_bytes=-1),
    edited_state(finished__repeated_ids=-2),
    edited_state(finished__output_checksum="x"),
]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"{not json", "unreadable state file"),
        (b'{"format": "something-else/9"}', "not a state file this version can resume"),
        (orjson.dumps({"format": STATE_FORMAT, "input": "x"}), "field 'rows_done' is missing"),
        *[(state, "unusable state file: field") for state in EDITED_STATES],
    ],
)
def test_resume_refused_with_a_bad_state_file(tmp_path: Path, content: bytes, expected: str) -> None:
    inp, out = write_input(tmp_path / "in.jsonl", 3), tmp_path / "rewards.jsonl"
    state_path(out).write_bytes(content)
    with pytest.raises(ResumeError, match=expected), open_run(inp, out, resume=True):
        pass


# --- one format, one writer ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["r.jsonl", "r.NDJSON", "r.json-lines", "r.Parquet", "r.csv", "r.json", "r"])
def test_the_input_and_the_output_accept_the_same_extensions(tmp_path: Path, name: str) -> None:
    """One table of formats serves both ends: a file the input reads, the output can be, and the other way round."""
    path = tmp_path / "in" / name
    path.parent.mkdir()
    if path.suffix.lower() == ".parquet":
        pq.write_table(pa.table({field: pa.array([], pa.string()) for field in FIELDS}), path)
    else:
        path.write_bytes(b"")
    try:
        open_rows(path).close()
        reads = True
    except InputError as exc:
        assert "unsupported extension" in str(exc)
        reads = False
    try:
        open_output(tmp_path / name, input_path=path, resume=False).close()
        writes = True
    except OutputError as exc:
        assert "unsupported extension" in str(exc)
        writes = False
    assert reads == writes == (name not in ("r.csv", "r.json", "r"))


@pytest.mark.timeout(60)
def test_the_output_side_never_opens_the_input() -> None:
    """Writing rewards, checkpoints, Parquet and the id count need nothing of the input's reader (a new process:
    what importing them loads, and nothing else)."""
    program = (
        "import json, sys; import engine._backfill.writer, engine._backfill.checkpoint, engine._backfill.parquet, "
        "engine._backfill.ids; print(json.dumps([m for m in sys.modules if m.startswith('engine._backfill.')]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=child_env(None), timeout=60, check=True
    )
    loaded = set(orjson.loads(done.stdout))
    assert "engine._backfill.files" in loaded
    assert not loaded & {"engine._backfill.input", "engine._backfill.run", "engine._backfill.bench"}


# --- misuse -----------------------------------------------------------------------------------


def test_misuse(tmp_path: Path) -> None:
    inp = write_input(tmp_path / "in.jsonl", 3)
    with pytest.raises(OutputError, match=r"unsupported extension '\.csv'"):
        open_output(tmp_path / "rewards.csv", input_path=inp, resume=False)
    with pytest.raises(OutputError, match="would replace the input"):
        open_output(inp, input_path=inp, resume=False)
    with pytest.raises(OutputError, match="cannot write"):
        open_output(tmp_path / "no" / "such" / "dir.jsonl", input_path=inp, resume=False)
    with open_output(tmp_path / "rewards.jsonl", input_path=inp, resume=False) as writer:
        with pytest.raises(ValueError, match="finite"):
            writer.write(1, math.nan, VERIFIER)
        with pytest.raises(ValueError, match="finite"):
            writer.write(1, math.inf, VERIFIER)
        with pytest.raises(TypeError, match="must be a float"):
            writer.write(1, True, VERIFIER)
        with pytest.raises(TypeError, match="must be a float"):
            writer.write(1, "0.5", VERIFIER)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="cannot be written as JSON"):
            writer.write(object(), 0.5, VERIFIER)
        assert writer.rows_written == 0  # nothing refused was written
        writer.write(1, 1, VERIFIER)  # an int reward is a float
        with pytest.raises(ValueError, match="checkpoint of 2 rows, but 1 records were written"):
            writer.checkpoint(2, EMPTY_CHECKSUM)
        writer.finish()
        with pytest.raises(ValueError, match="closed"):
            writer.write(2, 0.5, VERIFIER)
    assert list(read_rewards(tmp_path / "rewards.jsonl")) == [RewardRecord(1, 1.0, VERIFIER)]


# --- kill -9 ----------------------------------------------------------------------------------

SCRIPT = '''
"""Score an input with a deterministic stand-in verifier, checkpointing each chunk.

argv: input output chunk hold [--resume]. After ``hold`` checkpoints, it writes all but the last
record of the next chunk (more than a write buffer, so most of it reaches the file), says
"holding" and waits to be killed.
"""
import sys
from itertools import islice

from engine._backfill.run import open_run

input_path, output, chunk, hold = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
DIGEST = "sha256:" + "c" * 64
VERIFIER = {"kind": "endpoint", "ref": "http://127.0.0.1:1/score", "environment": "arith", "digest": DIGEST}

with open_run(input_path, output, resume="--resume" in sys.argv) as (rows, writer):
    print("started at", writer.rows_written, flush=True)
    checkpoints = 0
    while batch := list(islice(rows, chunk)):
        if checkpoints == hold:
            batch = batch[:-1]
        for row in batch:
            writer.write(row.id, row.task["i"] / 7 + len(row.trajectory) / 1000, VERIFIER)
        if checkpoints == hold:
            print("holding", flush=True)
            sys.stdin.read()
        writer.checkpoint(rows.rows_read, rows.checksum())
        checkpoints += 1
        print("checkpoint", writer.rows_written, flush=True)
    writer.finish()
print("done", flush=True)
'''

ROWS, CHUNK = 1000, 100


def start_script(tmp_path: Path, out: Path, hold: int, *, resume: bool = False) -> subprocess.Popen[bytes]:
    script = tmp_path / "backfill.py"
    script.write_text(SCRIPT)
    args = [sys.executable, str(script), str(tmp_path / "in.jsonl"), str(out), str(CHUNK), str(hold)]
    return subprocess.Popen(
        [*args, *(["--resume"] if resume else [])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def run_script(tmp_path: Path, out: Path, *, resume: bool = False) -> list[str]:
    proc = start_script(tmp_path, out, hold=-1, resume=resume)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()
    return stdout.decode().splitlines()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kill_at", ["while running", "mid-chunk"])
def test_kill_9_then_resume_gives_the_uninterrupted_output(tmp_path: Path, fmt: str, kill_at: str) -> None:
    write_input(tmp_path / "in.jsonl", ROWS)
    reference = tmp_path / f"reference.{fmt}"
    assert run_script(tmp_path, reference)[-1] == "done"

    out = tmp_path / f"rewards.{fmt}"
    # "while running": killed as soon as it reports its 2nd checkpoint, wherever it is then (it holds, at
    # the latest, in chunk 6, so it cannot finish first). "mid-chunk": killed with most of a chunk written.
    hold, wanted = (5, f"checkpoint {2 * CHUNK}") if kill_at == "while running" else (3, "holding")
    with start_script(tmp_path, out, hold=hold) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        seen: list[str] = []
        for _ in range(20):
            line = proc.stdout.readline().decode().strip()
            seen.append(line)
            if line in (wanted, ""):
                break
        if seen[-1] != wanted:
            proc.kill()
            pytest.fail(f"the script said {seen}, then: {proc.stderr.read().decode()}")
        no_resume_while_it_runs = pytest.raises(OutputError, match=rf"another run \(pid {proc.pid}")
        with no_resume_while_it_runs, open_run(tmp_path / "in.jsonl", out, resume=True):
            pass
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL

    assert not out.exists()
    done = state_of(out)["rows_done"]
    assert done >= 2 * CHUNK and done % CHUNK == 0
    if kill_at == "mid-chunk":
        assert done == 3 * CHUNK
        assert partial_path(out).stat().st_size > state_of(out)["output_bytes"]  # records past the checkpoint

    lines = run_script(tmp_path, out, resume=True)
    assert lines[0] == f"started at {done}"  # at most one chunk is scored again
    assert lines[-1] == "done"
    assert out.read_bytes() == reference.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["backfill.py", "in.jsonl", reference.name, out.name])


# --- kill -9 while finishing --------------------------------------------------------------------

FINISH_SCRIPT = """
sys.argv[0] = "score"
from itertools import islice

from engine._backfill.run import open_run

input_path, output = sys.argv[1], sys.argv[2]
VERIFIER = {"kind": "endpoint", "ref": "http://127.0.0.1:1/score", "environment": "arith"}
with open_run(input_path, output) as (rows, writer):
    while batch := list(islice(rows, 10)):
        for row in batch:
            writer.write(row.id, row.task["i"] / 7, VERIFIER)
        writer.checkpoint(rows.rows_read, rows.checksum())
    writer.finish()
"""


def start_finishing(tmp_path: Path, inp: Path, out: Path, stop: int) -> subprocess.Popen[str]:
    return start_under_trace(tmp_path / "finish.py", FINISH_SCRIPT, [str(inp), str(out)], stop)


def fork_finishing(folder: Path, inp: Path, out: Path, stop: int) -> ForkedRun:
    folder.mkdir()
    return fork_under_trace(folder, FINISH_SCRIPT, [str(inp), str(out)], stop)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill_9_at_every_step_of_finishing_resumes_to_the_same_output(tmp_path: Path, fmt: str) -> None:
    """A run killed before any one step of finish() (fsyncs, renames, removals, the lock) is never stuck.

    The runs killed are forked from the test's process (an interpreter's start for each of ~16 steps, twice,
    took most of the test's 40-90 s); the steps are the same as in a process of its own, which one run checks."""
    inp = write_input(tmp_path / "in.jsonl", 45)
    (tmp_path / "ref").mkdir()
    reference = tmp_path / "ref" / f"rewards.{fmt}"
    uninterrupted = start_finishing(tmp_path, inp, reference, 0)
    _, stderr = uninterrupted.communicate(timeout=60)
    assert uninterrupted.returncode == 0, stderr
    steps = finish_steps(stderr)
    forked = fork_finishing(tmp_path / "forked", inp, tmp_path / "forked" / f"rewards.{fmt}", 0)
    _, forked_stderr = forked.communicate()
    assert forked.returncode == 0, forked_stderr
    assert finish_steps(forked_stderr) == steps
    built = f"rewards.{fmt}.partial" if fmt == "jsonl" else "rewards.parquet.tmp"
    assert f"replace {built} -> rewards.{fmt}" in steps
    assert steps[-1] == f"unlink rewards.{fmt}.lock"

    completed = 0
    for step, name in enumerate(steps, 1):
        work = tmp_path / f"step-{step}"
        work.mkdir()
        out = work / f"rewards.{fmt}"
        assert kill_forked_at_step(fork_finishing(tmp_path / f"run-{step}", inp, out, step), step) == name
        tmp = out.with_name(out.name + ".tmp")  # Parquet's output while it is built
        if tmp.exists():  # a crash while writing it, or before its fsync, may leave any prefix
            with tmp.open("r+b") as f:
                f.truncate(tmp.stat().st_size // 2)
        if not state_path(out).exists():
            # Past the last step that matters: the output is complete and nothing is left to resume.
            assert out.read_bytes() == reference.read_bytes(), name
            with pytest.raises(ResumeError, match="no interrupted run to resume"), open_run(inp, out, resume=True):
                pass
        else:
            with pytest.raises(ResumeError, match="--resume"), open_run(inp, out):
                pass  # a fresh run is refused while the state is there, as documented
            renamed = out.exists() and out.read_bytes() == reference.read_bytes()
            with open_run(inp, out, resume=True) as (rows, writer):
                assert writer.already_finished == renamed, name  # complete: only the cleanup is left
                assert list(rows) == []
                writer.finish()
            completed += renamed
        assert out.read_bytes() == reference.read_bytes(), name
        assert sorted(p.name for p in work.iterdir()) == [out.name], name
        again = fork_finishing(tmp_path / f"again-{step}", inp, out, 0)  # and a fresh run starts over as usual
        assert again.communicate()[0] == "" and again.returncode == 0, name
        assert out.read_bytes() == reference.read_bytes(), name
    assert completed >= 2  # killed after the rename, before the state's removal, at least twice


def test_a_run_left_complete_by_an_older_version_resumes_to_its_cleanup(tmp_path: Path) -> None:
    """The state an older finish() left when killed after its JSON Lines rename: no finished marker, no partial."""
    inp, out = write_input(tmp_path / "in.jsonl", 20), tmp_path / "rewards.jsonl"
    reference = tmp_path / "ref" / "rewards.jsonl"
    reference.parent.mkdir()
    score_all(inp, reference)
    with open_run(inp, out) as (rows, writer):
        write_chunk(writer, list(rows))
        writer.checkpoint(rows.rows_read, rows.checksum())
    os.replace(partial_path(out), out)
    assert "finished" not in state_of(out)
    with open_run(inp, out, resume=True) as (rows, writer):
        assert writer.already_finished and writer.finished is None  # repeated ids: not counted then
        writer.finish()
    assert out.read_bytes() == reference.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["in.jsonl", "ref", out.name])


def test_a_changed_output_is_not_taken_for_a_finished_one(tmp_path: Path, fmt: str, reference: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / f"rewards.{fmt}"
    with open_run(inp, out) as (rows, writer):
        write_chunk(writer, list(rows))
        writer.checkpoint(rows.rows_read, rows.checksum())
    out.write_bytes(reference.read_bytes()[:-1])  # a complete-looking output that is not this run's
    with open_run(inp, out, resume=True) as (rows, writer):
        assert not writer.already_finished  # the partial file is there: the output is built again
        writer.finish()
    assert out.read_bytes() == reference.read_bytes()


@pytest.mark.timeout(60)
def test_repeated_ids_are_counted_exactly_in_buckets(tmp_path: Path, fmt: str) -> None:
    inp, out = write_input(tmp_path / "in.jsonl", 1), tmp_path / f"rewards.{fmt}"
    n, distinct = 140_000, 100_000  # more hashes than one bucket holds: spread over several
    with open_output(out, input_path=inp, resume=False) as writer:
        for i in range(n):
            writer.write(f"id-{i % distinct}" if i % 1000 else None, 0.5, VERIFIER)
        writer.finish()
        assert writer.finished is not None
    repeats = [i for i in range(distinct, n) if i % 1000]  # rows with an id an earlier row had
    assert writer.finished.repeated_ids == len(repeats)
    assert writer.finished.ids_repeated == len({i % distinct for i in repeats})


@pytest.mark.parametrize("interrupted_at", [None, 3], ids=["one run", "resumed"])
def test_repeated_ids_count_json_equal_ids_as_one_and_null_written_ids_as_none(
    tmp_path: Path, fmt: str, interrupted_at: int | None
) -> None:
    """An object id is one id whatever its keys' order; NaN and infinity are written as null: no id, no repeat."""
    inp, out = write_input(tmp_path / "in.jsonl", 1), tmp_path / f"rewards.{fmt}"
    ids: list[Any] = [{"a": 1, "b": 2}, math.nan, None, {"b": 2, "a": 1}, math.nan, math.inf, -math.inf, "x", "x"]
    writer = open_output(out, input_path=inp, resume=False)
    for n, row_id in enumerate(ids):
        if n == interrupted_at:  # checkpointed, then stopped: the resume rebuilds the ids from the partial file
            writer.checkpoint(n, EMPTY_CHECKSUM)
            writer.close()
            writer = open_output(out, input_path=inp, resume=True)
        writer.write(row_id, 0.5, VERIFIER)
    writer.finish()
    assert writer.finished is not None
    assert (writer.finished.repeated_ids, writer.finished.ids_repeated) == (2, 2)  # the object once, "x" once
    assert [r.id for r in read_rewards(out)][1:3] == [None, None]
