"""``engine score --ray`` and ``engine.ray``: backfills on a real local Ray, against the single-machine output.

One local Ray serves the whole module (starting one costs seconds): 8 logical CPUs on whatever
cores the machine has, so that actors and Ray Data's own tasks never wait for each other (on 2
cores, 1-CPU actors alone would take every CPU: ray issue 44687), the dashboard off, and Ray
Data's no-progress timeout short, so that a hang fails its test instead of waiting 30 minutes.
The CLI runs in-process (it joins that Ray) except where the process is the point: a driver
killed with SIGKILL runs as ``python -m engine`` in a subprocess that connects to it by address.

Every output is compared by id with the single-machine ``engine score`` of the same rows: the same
rows, each exactly once, with the same rewards and provenance.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import subprocess
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import ray.data
from cli_support import (
    VERL_COLUMNS,
    Workspace,
    child_env,
    copy_env,
    engine_command,
    records,
    verl_reward,
    verl_rows,
    write_rows,
)
from polling import wait_until

import engine
from engine import InputError, VerificationError, _json
from engine._backfill.parquet import JSON_COLUMNS_KEY, output_batch, output_schema, read_records
from engine._ray.actor import split_limits
from engine._ray.plan import committed, make_plan, resolve_inputs
from engine._ray.run import NO_PROGRESS_VARIABLE, _committed_provenances
from engine.cli import EXIT_BAD_INPUT
from engine.ray import backfill, engine_error, score_dataset

pytestmark = pytest.mark.timeout(180)  # Ray actors start in seconds, more on a loaded 2-core machine

HANG_TIMEOUT = "120"  # seconds without progress before Ray Data fails a job: a hang fails the test, not CI
ENV = "rayplug"
PLUGIN = '''
import os, signal, time


def score(task, trajectory):
    n = task["n"]
    log = task.get("log")
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{n}\\n".encode())  # one O_APPEND write: lines never interleave
        finally:
            os.close(fd)
    if task.get("sleep"):
        time.sleep(task["sleep"])
    fixed = task.get("fail_unless")
    if fixed is not None and not os.path.exists(fixed):
        raise RuntimeError(f"row {n} fails until {fixed} exists")
    marker = task.get("die_once")
    if marker is not None and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)  # the actor (the plugin runs in its threads) dies mid-block
    return (n * 37 % 101) / 100 + len(str(trajectory)) / 1000
'''


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray for this module's tests; its address, for drivers in other processes."""
    before = os.environ.get(NO_PROGRESS_VARIABLE)
    os.environ[NO_PROGRESS_VARIABLE] = HANG_TIMEOUT  # read by the drivers here and, inherited, in subprocesses
    ray.init(num_cpus=8, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    with warnings.catch_warnings():  # Ray 2.60's DataContext warns about its own deprecated defaults as it is built
        warnings.simplefilter("ignore", DeprecationWarning)
        ray.data.DataContext.get_current()
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        if before is None:
            os.environ.pop(NO_PROGRESS_VARIABLE, None)
        else:
            os.environ[NO_PROGRESS_VARIABLE] = before


@pytest.fixture
def space(tmp_path: Path) -> Workspace:
    """A workspace whose one environment's plugin logs, sleeps, fails or kills its process as a row's task says."""
    work = Workspace(tmp_path)
    (work.envs / ENV).mkdir(parents=True)
    (work.envs / ENV / "verify.py").write_text(PLUGIN)
    manifest = {"kind": "environment", "verifier": {"kind": "plugin", "ref": "verify:score"}}
    (work.envs / ENV / "manifest.json").write_bytes(orjson.dumps(manifest))
    work.write_config()
    return work


def rows(count: int, first: int = 0, **task: Any) -> list[dict[str, Any]]:
    return [
        {"id": f"row-{n:05d}", "environment": ENV, "task": {"n": n, **task}, "trajectory": f"answer {n}"}
        for n in range(first, first + count)
    ]


def by_id(outdir: Path) -> dict[Any, tuple[float, Any]]:
    """Every record of a --ray output directory by id; fails if an id is there twice."""
    seen: dict[Any, tuple[float, Any]] = {}
    for part in sorted(outdir.glob("part-*.parquet")):
        for row_id, reward, verifier in read_records(part):
            assert row_id not in seen, f"id {row_id!r} is in the output twice"
            seen[row_id] = (reward, verifier)
    return seen


def single(space: Workspace, *inputs: Path) -> dict[Any, tuple[float, Any]]:
    """The single-machine ``engine score`` output of ``inputs``, by id."""
    expected: dict[Any, tuple[float, Any]] = {}
    for number, path in enumerate(inputs):
        out = space.root / f"single-{number}.parquet"
        ran = space.score(path, out)
        assert ran.returncode == 0, ran.stderr
        expected.update((r.id, (r.reward, r.verifier)) for r in records(out))
    return expected


def reap(process: subprocess.Popen[str]) -> None:
    """``process`` killed if it still runs, waited for, and its stderr pipe closed."""
    if process.poll() is None:
        process.kill()
        process.wait(timeout=30)
    assert process.stderr is not None
    process.stderr.close()


def logged(log: Path) -> Counter[int]:
    return Counter(int(line) for line in log.read_text().split()) if log.exists() else Counter()


def test_a_parts_distinct_verifiers_are_read_by_arrow_with_the_judges_parameters_and_without_cached(
    tmp_path: Path,
) -> None:
    # what a --ray --resume checks before scoring: a struct inside the verifier struct cannot be a group key
    judge = {"model": "m", "base_url": "http://127.0.0.1:9/v1", "temperature": 0.0, "max_tokens": 512,
             "response_format": True}
    graded = {"kind": "rubric", "ref": "a/b@1", "environment": "h", "digest": "sha256:1", "version": 1, "prompt": 1,
              "model": "m", "judge": judge}
    plugin = {"kind": "plugin", "ref": "verify:score", "environment": "p", "digest": "sha256:2"}
    provenances = [graded, {**graded, "cached": 1.5}, {**graded, "cached": 2.5}, plugin, {**graded, "version": 2}]
    schema = output_schema("int")
    batch = output_batch(schema, list(range(5)), [0.5] * 5, provenances)
    pq.write_table(pa.Table.from_batches([batch]), tmp_path / "part-a.parquet")
    assert _committed_provenances(tmp_path, ["part-a.parquet"]) == {
        "h": [graded, {**graded, "version": 2}],  # a hit is the same verifier's; another version is not
        "p": [plugin],
    }


def test_a_directory_scored_on_ray_equals_the_single_machine_output_row_for_row(space: Workspace, cluster: str) -> None:
    indir = space.root / "in"
    indir.mkdir()
    jsonl = write_rows(indir / "a.jsonl", rows(2_400))
    parquet = indir / "b.parquet"
    table = pa.table({key: [r[key] if key != "task" else orjson.dumps(r["task"]).decode() for r in rows(1_600, 2_400)]
                      for key in ("id", "environment", "task", "trajectory")})
    pq.write_table(table, parquet, row_group_size=200)
    outdir = space.root / "out"

    # blocks of 1,000 rows: the JSON Lines file in three (the last short), the Parquet one in two of 5 row groups
    ran = space.score(indir, outdir, "--ray", "--actors", "2", "--chunk-size", "1000")

    assert ran.returncode == 0, ran.stderr
    got = by_id(outdir)
    assert len(got) == 4_000
    assert got == single(space, jsonl, parquet)
    assert (outdir / "_SUCCESS").is_file()
    assert len(committed(outdir)) == 5
    assert pq.read_schema(next(outdir.glob("part-*.parquet"))).names == ["id", "reward", "verifier"]
    assert pq.read_table(outdir).num_rows == 4_000  # the directory reads as one table: no stray file in it


def test_fewer_blocks_than_actors_start_one_actor_per_block(space: Workspace, cluster: str) -> None:
    # as a resume with one block left does: an actor with no block would never start its work, and Ray Data
    # warns about the pool's minimum as the input ends (the warning once ended such a run with exit 70)
    source = write_rows(space.root / "in.jsonl", rows(300))
    outdir = space.root / "out"

    ran = space.score(source, outdir, "--ray", "--actors", "4", "--chunk-size", "500")

    assert ran.returncode == 0, ran.stderr
    assert "minimum number of concurrent actors" not in ran.stderr
    assert by_id(outdir) == single(space, source)
    assert len(committed(outdir)) == 1


def test_a_second_run_after_success_changes_nothing(space: Workspace, cluster: str) -> None:
    log = space.root / "calls.log"
    source = write_rows(space.root / "in.jsonl", rows(2_000, log=str(log)))
    outdir = space.root / "out"
    # relative paths, the config's environments too: actors do not share the driver's working directory
    first = space.run("score", "in.jsonl", "-o", "out", "--config", "engine.toml", "--ray", "--chunk-size", "500")
    assert first.returncode == 0, first.stderr
    files = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in outdir.iterdir()}
    assert len(committed(outdir)) == 4

    again = space.score(source, outdir, "--ray", "--chunk-size", "500")
    resumed = space.score(source, outdir, "--ray", "--chunk-size", "500", "--resume")

    assert again.returncode == 0 and resumed.returncode == 0, again.stderr + resumed.stderr
    assert "already complete" in again.stdout and "already complete" in resumed.stdout
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in outdir.iterdir()} == files
    assert logged(log) == Counter(range(2_000))  # every row scored once, by the first run alone


def test_a_failing_row_aborts_with_exit_1_naming_its_id_and_resume_finishes(space: Workspace, cluster: str) -> None:
    fixed = space.root / "fixed"
    items = rows(3_000)
    items[1_234]["task"]["fail_unless"] = str(fixed)
    source = write_rows(space.root / "in.jsonl", items)
    outdir = space.root / "out"

    ran = space.score(source, outdir, "--ray", "--chunk-size", "500")

    assert ran.returncode == 1, ran.stderr
    assert "plugin verifier 'verify:score'" in ran.stderr and "id 'row-01234'" in ran.stderr
    assert f"input: {source}, line 1235" in ran.stderr
    assert f"parts committed so far are kept in {outdir}: run the same command with --resume to continue" in ran.stderr
    assert not (outdir / "_SUCCESS").exists()
    assert "part-000000001000-000000001500.parquet" not in committed(outdir)  # its block was never committed
    assert "row-01234" not in by_id(outdir)  # never a zero in its place

    before = 500 * len(committed(outdir))
    fixed.touch()
    resumed = space.score(source, outdir, "--ray", "--chunk-size", "500", "--resume")

    assert resumed.returncode == 0, resumed.stderr
    assert by_id(outdir) == single(space, source)
    assert (outdir / "_SUCCESS").is_file()
    # the summary says what a single-machine resume's says: this run's rows, the whole output's rewards
    rewards = [reward for reward, _ in by_id(outdir).values()]
    covered = f"the {3_000 - before:,} rows of this run" if before else "all 3,000 rows"  # its verifiers' figures
    assert f"per verifier, {covered}" in resumed.stdout
    assert f"rewards of all 3,000 rows: mean {math.fsum(rewards) / 3_000:.4f}, " in resumed.stdout
    assert f"min {min(rewards):g}, max {max(rewards):g}" in resumed.stdout
    assert f"\nscored {3_000 - before:,} rows in " in resumed.stdout
    committed_before = f" (resumed at {before:,} rows committed)" if before else ""
    assert f"3,000 rewards written to {outdir} in 6 parts{committed_before}\n" in resumed.stdout


def test_the_driver_killed_mid_run_then_resume_gives_every_row_exactly_once(space: Workspace, cluster: str) -> None:
    log = space.root / "calls.log"
    source = write_rows(space.root / "in.jsonl", rows(2_000, log=str(log), sleep=0.002))
    outdir = space.root / "out"
    command = engine_command("score", source, "-o", outdir, "--config", space.config, "--ray", "--chunk-size", "100",
                             "--address", cluster)
    driver = subprocess.Popen(command, cwd=space.root, env=child_env(None), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(committed(outdir)) >= 2 or driver.poll() is not None, 120, "no block was committed")
        assert driver.poll() is None, driver.communicate()[1]
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        reap(driver)
    assert driver.returncode == -signal.SIGKILL
    assert not (outdir / "_SUCCESS").exists()
    before = committed(outdir)
    assert 2 <= len(before) < 20

    resumed = space.score(source, outdir, "--ray", "--chunk-size", "100", "--resume")

    assert resumed.returncode == 0, resumed.stderr
    assert by_id(outdir) == single(space, source)  # every row exactly once, as one machine scores it
    calls = logged(log)
    for name in before:  # a block committed before the kill was not scored again
        start, stop = (int(n) for n in name.removeprefix("part-").removesuffix(".parquet").split("-"))
        assert all(calls[n] == 2 for n in range(start, stop)), name  # once on Ray, once by `single`


def test_an_actor_killed_mid_block_is_restarted_and_its_block_scored_again(space: Workspace, cluster: str) -> None:
    log, marker = space.root / "calls.log", space.root / "died"
    items = rows(2_000, log=str(log))
    items[700]["task"]["die_once"] = str(marker)
    source = write_rows(space.root / "in.jsonl", items)
    outdir = space.root / "out"

    options = ("enable_progress_bars", "execution_no_progress_timeout_s", "raise_original_map_exception")
    before = {name: getattr(ray.data.DataContext.get_current(), name) for name in options}

    summary = backfill(source, outdir, engine.load_config(space.config), actors=2, actor_cpus=0.5, block_rows=500)

    assert {name: getattr(ray.data.DataContext.get_current(), name) for name in options} == before  # the driver's

    assert marker.exists()  # the actor did die
    assert summary.rows == 2_000 and not summary.already_complete
    calls = logged(log)
    assert calls[700] == 2  # its block was retried on a new actor (the row's call that killed it, then again)
    assert by_id(outdir) == single(space, source)


def test_score_dataset_adds_reward_and_verifier_and_a_failure_fails_the_dataset(
    space: Workspace, cluster: str
) -> None:
    config = engine.load_config(space.config)
    source = write_rows(space.root / "in.jsonl", rows(1_000))
    expected = single(space, source)
    dataset = ray.data.from_items(rows(1_000))

    scored = score_dataset(dataset, config, actors=2, actor_cpus=0.5, batch_size=250).take_all()

    got = {r["id"]: (r["reward"], {k: v for k, v in r["verifier"].items() if v is not None}) for r in scored}
    assert got == expected
    bad = rows(1_000)
    bad[321]["task"]["fail_unless"] = str(space.root / "never")
    with pytest.raises(Exception) as raised:  # Ray makes one struct of every row's task keys: never given as None
        score_dataset(ray.data.from_items(bad), config, actors=1, actor_cpus=0.5, batch_size=250).take_all()
    error = engine_error(raised.value)
    assert isinstance(error, InputError) and "task.fail_unless is null in a struct column" in error.reason, raised.value
    as_text = [{**item, "task": orjson.dumps(item["task"]).decode()} for item in bad]  # each row's own keys
    with pytest.raises(Exception) as raised:
        score_dataset(ray.data.from_items(as_text), config, actors=1, actor_cpus=0.5, batch_size=250).take_all()
    error = engine_error(raised.value)
    assert isinstance(error, VerificationError) and error.item_id == "row-00321", raised.value
    # its typed fields crossed from the actor's process whole (a timeout or a load failure would say so)
    assert (error.key, error.timed_out, error.cannot_load) == (f"{ENV}/verify:score", False, False), raised.value
    dropping = ray.data.from_items(bad)
    dropping.context.max_errored_blocks = 1  # would drop the block of a failing row: refused
    with pytest.raises(ValueError, match="max_errored_blocks"):
        score_dataset(dropping, config)


def test_wide_integers_and_text_trajectories_reach_the_plugins_exactly_on_ray(space: Workspace, cluster: str) -> None:
    """Through the actors as through one process: a task's 2**64 + 1 stays an integer (JSON Lines, Parquet JSON
    text), and a trajectory is decoded only where --json-columns says so; the plugins score 1.0 only then."""
    copy_env("wide_int", space.envs)
    copy_env("exact_trajectory", space.envs)
    wide = [{"id": f"w{n}", "environment": "wide_int", "task": {"reference": 2**64 + 1}, "trajectory": "t"}
            for n in range(300)]
    nested = [{"id": f"x{n}", "environment": "exact_trajectory", "task": {"expected": [{"n": n}, "text"]},
               "trajectory": [{"n": n}, "text"]} for n in range(300)]
    indir = space.root / "in"
    indir.mkdir()
    (indir / "a.jsonl").write_bytes(b"".join(_json.dumps(item) + b"\n" for item in wide))

    def as_json_text(items: list[dict[str, Any]]) -> pa.Table:
        return pa.table({key: [_json.dumps(item[key]).decode() if key in ("task", "trajectory") else item[key]
                               for item in items] for key in ("id", "environment", "task", "trajectory")})

    pq.write_table(as_json_text([{**item, "id": f"p{n}"} for n, item in enumerate(wide)]), indir / "b.parquet",
                   row_group_size=100)
    pq.write_table(as_json_text(nested), indir / "c.parquet", row_group_size=100)
    listed = as_json_text(nested).replace_schema_metadata({JSON_COLUMNS_KEY: b"trajectory"})
    pq.write_table(listed, space.root / "listed.parquet", row_group_size=100)

    ran = space.score(indir, space.root / "out", "--ray", "--chunk-size", "100", "--json-columns", "trajectory")
    by_metadata = space.score(space.root / "listed.parquet", space.root / "meta", "--ray", "--chunk-size", "100")

    assert ran.returncode == 0, ran.stderr
    assert by_metadata.returncode == 0, by_metadata.stderr
    got = by_id(space.root / "out")
    assert len(got) == 900 and {reward for reward, _ in got.values()} == {1.0}
    assert {reward for reward, _ in by_id(space.root / "meta").values()} == {1.0}


def test_verls_own_parquet_is_scored_on_ray_through_the_column_mapping(space: Workspace, cluster: str) -> None:
    """Every actor reads its blocks through the mapping --columns gives (and score_dataset its batches); a run
    with another mapping is another input; a source the file lacks is refused before Ray is asked for anything."""
    copy_env("verl_gsm8k", space.envs)
    source = space.root / "in.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows(40)), source, row_group_size=10)
    outdir = space.root / "out"
    answers = VERL_COLUMNS.replace("trajectory=response", "trajectory=extra_info.answer")  # every row right

    ran = space.score(source, outdir, "--ray", "--chunk-size", "20", "--columns", VERL_COLUMNS)
    other = space.score(source, outdir, "--ray", "--chunk-size", "20", "--columns", answers)
    missing = space.score(source, space.root / "missing", "--ray", "--columns", VERL_COLUMNS.replace("=data", "=x"))
    mapping = dict(pair.split("=") for pair in answers.split(","))
    dataset = score_dataset(ray.data.from_arrow(pq.read_table(source)), engine.load_config(space.config), actors=1,
                            actor_cpus=0.5, batch_size=20, columns=mapping).take_all()

    assert ran.returncode == 0, ran.stderr
    assert {row_id: reward for row_id, (reward, _) in by_id(outdir).items()} == {
        1000 + n: verl_reward(n) for n in range(40)}
    assert other.returncode == EXIT_BAD_INPUT and "holds the complete output of another input" in other.stderr
    assert missing.returncode == EXIT_BAD_INPUT, missing.stderr
    assert "missing column(s) 'x_source' (read as environment)" in missing.stderr
    assert sorted((row["extra_info"]["index"], row["reward"]) for row in dataset) == [
        (1000 + n, 1.0) for n in range(40)]


def test_resume_scores_again_a_part_cut_short_or_overwritten_and_every_part_then_reads(
    space: Workspace, cluster: str
) -> None:
    log = space.root / "calls.log"
    source = write_rows(space.root / "in.jsonl", rows(800, log=str(log)))
    outdir = space.root / "out"
    first = space.score(source, outdir, "--ray", "--chunk-size", "200")
    assert first.returncode == 0, first.stderr
    parts = sorted(outdir.glob("part-*.parquet"))
    assert len(parts) == 4
    cut, garbage = parts[1], parts[2]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])  # truncated by hand
    garbage.write_bytes(b"not a parquet file at all")
    (outdir / "_SUCCESS").unlink()  # as an interrupted run leaves it

    resumed = space.score(source, outdir, "--ray", "--chunk-size", "200", "--resume")

    assert resumed.returncode == 0, resumed.stderr
    assert f"re-scored 2 parts that were not whole (cut short or overwritten since committed): {cut.name}, " \
           f"{garbage.name}" in resumed.stdout
    for part in sorted(outdir.glob("part-*.parquet")):
        start, stop = (int(n) for n in part.name.removeprefix("part-").removesuffix(".parquet").split("-"))
        assert pq.read_table(part).num_rows == stop - start, part.name
    assert pq.read_table(outdir).num_rows == 800
    calls = logged(log)
    assert [calls[n] for n in (0, 200, 400, 600)] == [1, 2, 2, 1]  # only the two broken blocks, again
    assert by_id(outdir) == single(space, source)
    assert (outdir / "_SUCCESS").is_file()

    parts[3].write_bytes(parts[3].read_bytes()[:-100])  # after success: the output no longer is complete
    again = space.score(source, outdir, "--ray", "--chunk-size", "200", "--resume", "--actors", "1")  # one block
    assert again.returncode == 0, again.stderr
    assert f"re-scored 1 part that was not whole (cut short or overwritten since committed): {parts[3].name}" \
        in again.stdout
    assert pq.read_table(outdir).num_rows == 800 and (outdir / "_SUCCESS").is_file()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_every_actor_scores_through_one_engine_serve_with_url(space: Workspace, cluster: str) -> None:
    port = free_port()
    service = subprocess.Popen(engine_command("serve", "--config", space.config, "--port", str(port)), cwd=space.root,
                               env=child_env(None), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert service.poll() is None, service.communicate()[1]
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    try:
        wait_until(up, 60, "engine serve never listened")
        source = write_rows(space.root / "in.jsonl", rows(1_000))
        outdir = space.root / "out"
        ran = space.run("score", source, "-o", outdir, "--ray", "--url", url, "--chunk-size", "250")
        assert ran.returncode == 0, ran.stderr
        assert by_id(outdir) == single(space, source)
    finally:
        service.send_signal(signal.SIGTERM)
        try:
            service.wait(timeout=30)
        finally:
            reap(service)


# No Ray below: what imports it, how limits are split, and what an input names.


def test_neither_the_engine_nor_its_command_imports_ray() -> None:
    probe = (
        "import sys, engine, engine.cli, engine.ray\n"
        "[getattr(engine, name) for name in engine.__all__]\n"
        "print('ray' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=child_env(None), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_each_actor_gets_its_share_of_every_verifiers_limits() -> None:
    limits = engine.Limits(max_concurrency=5, max_rate=10.0)
    judge = engine.JudgeConfig(base_url="http://127.0.0.1:1/v1", model="m", max_concurrency=7, max_rate=3.0)
    config = engine.EngineConfig(defaults=limits, refs={"e/verify:score": engine.Limits(max_concurrency=1)},
                                 judge=judge)

    shared = split_limits(config, 3)

    assert (shared.defaults.max_concurrency, shared.defaults.max_rate) == (2, 10.0 / 3)
    assert (shared.refs["e/verify:score"].max_concurrency, shared.refs["e/verify:score"].max_rate) == (1, None)
    assert shared.judge is not None
    assert (shared.judge.max_concurrency, shared.judge.max_rate) == (math.ceil(7 / 3), 1.0)
    assert shared.defaults.timeout == limits.timeout  # nothing else changes
    assert split_limits(config, 1) == config


def test_an_input_is_a_file_a_directory_or_a_glob_and_blocks_name_their_lines(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    first = write_rows(tmp_path / "d" / "a.jsonl", rows(5))
    second = write_rows(tmp_path / "d" / "sub" / "b.jsonl", rows(3))
    hidden = write_rows(tmp_path / "d" / "_hidden.jsonl", rows(1))
    (tmp_path / "d" / "notes.txt").write_text("not an input")
    assert resolve_inputs(tmp_path / "d") == [first, second]  # as Parquet readers read a directory
    assert resolve_inputs(f"{tmp_path}/d/**/*.jsonl") == [hidden, first, second]  # a glob: all it matches
    assert resolve_inputs(first) == [first]
    with pytest.raises(engine.InputError, match="no such file"):
        resolve_inputs(tmp_path / "missing.jsonl")

    first.write_bytes(b"\n".join(orjson.dumps(r) for r in rows(2)) + b"\n\n\n" + orjson.dumps(rows(1, 2)[0]) + b"\n")
    plan = make_plan([first, second], block_rows=2)

    starts = [(b.file, b.start, b.rows, b.number) for b in plan.blocks]
    assert starts == [(0, 0, 2, 1), (0, 2, 1, 5), (1, 3, 2, 1), (1, 5, 1, 3)]  # line 5: after two blank lines
    assert plan.rows == 6


def test_a_ray_output_audits_and_a_resume_under_an_edited_plugin_refuses_naming_both(
    space: Workspace, cluster: str
) -> None:
    source = write_rows(space.root / "in.jsonl", rows(6))
    outdir = space.root / "out"
    assert space.score(source, outdir, "--ray", "--chunk-size", "2").returncode == 0
    audited = space.run("audit", outdir, "--input", source, "--config", space.config, "--sample", "6", "--json")
    assert audited.returncode == 0, audited.stderr
    (verifier,) = orjson.loads(audited.stdout)["verifiers"]
    assert verifier["compared"] == verifier["equal"] == 6 and verifier["provenance_changed"] == 0
    # the state of a run stopped before its last two parts were committed (two: one block per actor)
    (outdir / "_SUCCESS").unlink()
    first, *left = sorted(committed(outdir))
    for name in left:
        (outdir / name).unlink()
    before = engine.digest_directory(space.envs / ENV)
    verify = space.envs / ENV / "verify.py"
    original = verify.read_text()
    verify.write_text(original.replace("n * 37 % 101", "n * 41 % 101"))  # other rewards, a new digest
    after = engine.digest_directory(space.envs / ENV)
    refused = space.score(source, outdir, "--ray", "--chunk-size", "2", "--resume")
    assert refused.returncode == EXIT_BAD_INPUT, refused.stderr
    assert f"environment '{ENV}'" in refused.stderr and before in refused.stderr and after in refused.stderr
    assert "new output directory" in refused.stderr
    assert committed(outdir) == {first} and not (outdir / "_SUCCESS").exists()  # nothing scored, nothing mixed
    verify.write_text(original)  # the configuration the run started with: it resumes
    resumed = space.score(source, outdir, "--ray", "--chunk-size", "2", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert by_id(outdir) == single(space, source)
