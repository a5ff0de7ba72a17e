"""``engine audit``, ``engine diff`` and the resume that refuses a changed verifier, on outputs ``engine score`` wrote.

Every stored output here is a real run's; the judge is a real HTTP server on 127.0.0.1 whose replies change with the
call's number (a judge at temperature > 0, as far as an audit can tell).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest
from cli_support import PLUGIN_ENV, RUBRICS, Workspace, make_workspace, records, row, rows, write_rows
from conftest import add_rubric_env
from servers import Request, Response, Server, score

import engine
from engine._cli.lifecycle import EXIT_BAD_INPUT, EXIT_DISAGREE, EXIT_OK

HELPFUL = "bob/helpfulness"  # scale [1, 5]


def pin_config(space: Workspace, extra: str = "") -> None:
    """Pin the plugin at its digest now (a new digest is a new provenance)."""
    digest = engine.digest_directory(space.envs / PLUGIN_ENV)
    space.config.write_text(f'environments = "envs"\n{extra}\n[pins]\n{PLUGIN_ENV} = "{digest}"\n')


@pytest.fixture
def scored(tmp_path: Path) -> tuple[Workspace, Path, Path]:
    space = make_workspace(tmp_path, PLUGIN_ENV)
    pin_config(space)
    source = write_rows(space.root / "in.jsonl", rows(40))
    out = space.root / "out.jsonl"
    assert space.score(source, out).returncode == EXIT_OK
    return space, source, out


def audit_json(space: Workspace, out: Path, source: Path, *extra: str,
               env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    ran = space.run("audit", out, "--input", source, "--config", space.config, "--json", *extra, env=env)
    assert ran.returncode in (EXIT_OK, EXIT_DISAGREE), ran.stderr
    data: dict[str, Any] = orjson.loads(ran.stdout)
    return ran.returncode, data


def test_a_deterministic_plugin_audits_clean(scored: tuple[Workspace, Path, Path]) -> None:
    space, source, out = scored
    code, data = audit_json(space, out, source, "--sample", "10", "--seed", "3", "--repeat", "2")
    assert code == EXIT_OK
    assert data["rows"] == 40 and data["sampled"] == 10 and data["agrees"] is True
    (verifier,) = data["verifiers"]
    assert verifier["environment"] == PLUGIN_ENV and verifier["provenance_changed"] == 0
    assert verifier["compared"] == verifier["equal"] == 10 and verifier["max_abs_diff"] == 0.0
    assert verifier["noise_max"] == 0.0 and verifier["noisy"] == 0  # a deterministic plugin has no noise floor
    assert verifier["confusion"] is None  # its rewards are not all 0 or 1
    table = space.run("audit", out, "--input", source, "--config", space.config, "--fraction", "0.5")
    assert table.returncode == EXIT_OK and "20 of 40 rows" in table.stdout, table.stdout


def test_the_same_seed_draws_the_same_rows_and_another_seed_others(
    scored: tuple[Workspace, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    space, source, out = scored
    config = engine.load_config(space.config)
    log = space.root / "calls.log"
    drawn = []
    for seed in (1, 1, 2):
        log.unlink(missing_ok=True)
        monkeypatch.setenv("ENGINE_TEST_CALL_LOG", str(log))  # the plugin logs each row it scores
        asyncio.run(engine.audit(out, input=source, config=config, sample=5, seed=seed))
        drawn.append(sorted(log.read_text().split()))
    assert drawn[0] == drawn[1] and drawn[0] != drawn[2]


def test_an_edited_plugin_is_a_provenance_change_not_a_disagreement(scored: tuple[Workspace, Path, Path]) -> None:
    space, source, out = scored
    verify = space.envs / PLUGIN_ENV / "verify.py"
    verify.write_text(verify.read_text().replace("n * 37 % 101", "n * 41 % 101"))  # other rewards, a new digest
    pin_config(space)
    code, data = audit_json(space, out, source, "--sample", "8")
    assert code == EXIT_OK  # nothing compared disagrees: every row was scored by another verifier
    (verifier,) = data["verifiers"]
    assert verifier["provenance_changed"] == 8 and verifier["compared"] == 0
    assert verifier["stored_provenance"]["digest"] != verifier["current_provenance"]["digest"]
    assert verifier["current_provenance"]["digest"] == engine.digest_directory(space.envs / PLUGIN_ENV)
    shown = space.run("audit", out, "--input", source, "--config", space.config, "--sample", "8")
    assert "provenance changed on 8 of 8 rows" in shown.stdout, shown.stdout


class Phases:
    """A judge's replies by the call's number: the first ``first`` calls score ``high``, the next ``first`` ``low``,
    every later one ``high`` again (so a repeated audit pass sees another verdict than the one before it)."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.calls = itertools.count()
        self.lock = threading.Lock()

    def __call__(self, request: Request) -> Response:
        with self.lock:
            n = next(self.calls)
        return score(1 if self.first <= n < 2 * self.first else 5)


@pytest.fixture
def judged(tmp_path: Path) -> Iterator[tuple[Workspace, Path, Path]]:
    with Server.judge(default=Phases(6)) as judge:
        config = f'rubrics = "rubrics"\n\n[judge]\nbase_url = "{judge.base_url}"\nmodel = "judge-test"\n'
        space = make_workspace(tmp_path, config=config)
        shutil.copytree(RUBRICS, space.root / "rubrics")
        add_rubric_env(space.envs, "helpful", HELPFUL)
        source = write_rows(space.root / "in.jsonl", [row(n, "helpful", prompt=f"q {n}") for n in range(6)])
        out = space.root / "out.jsonl"
        assert space.score(source, out).returncode == EXIT_OK
        yield space, source, out


def test_a_judge_that_answers_otherwise_disagrees_and_shows_its_noise_floor(
    judged: tuple[Workspace, Path, Path],
) -> None:
    space, source, out = judged
    assert {r.reward for r in records(out)} == {1.0}
    code, data = audit_json(space, out, source, "--sample", "6", "--repeat", "2")
    assert code == EXIT_DISAGREE
    (verifier,) = data["verifiers"]
    assert verifier["kind"] == "rubric" and verifier["provenance_changed"] == 0
    assert verifier["compared"] == 6 and verifier["equal"] == 0 and verifier["max_abs_diff"] == 1.0
    assert verifier["confusion"] == {"1->1": 0, "1->0": 6, "0->1": 0, "0->0": 0}
    assert verifier["noise_max"] == 1.0 and verifier["noisy"] == 6  # the second pass judged otherwise again
    within = space.run("audit", out, "--input", source, "--config", space.config, "--tolerance", "1")
    assert within.returncode == EXIT_OK, within.stdout


def test_resume_under_a_new_rubric_version_refuses_naming_both_and_restart_starts_over(tmp_path: Path) -> None:
    with Server.judge(default=score(3)) as judge:
        config = f'rubrics = "rubrics"\n\n[judge]\nbase_url = "{judge.base_url}"\nmodel = "judge-test"\n'
        space = make_workspace(tmp_path, PLUGIN_ENV, config=config)
        shutil.copytree(RUBRICS, space.root / "rubrics")
        add_rubric_env(space.envs, "helpful", HELPFUL)
        items = [row(n, "helpful", prompt=f"q {n}") for n in range(4)]
        items[3] = {**row(3, PLUGIN_ENV), "task": {"n": 3, "poison": True}}  # stops the run after 2 chunks
        source = write_rows(space.root / "in.jsonl", [*items, row(4, "helpful", prompt="q 4")])
        out = space.root / "out.jsonl"
        env = {"ENGINE_TEST_FIXED": str(space.root / "fixed")}
        assert space.score(source, out, "--chunk-size", "2", env=env).returncode == 1
        version2 = space.root / "rubrics" / HELPFUL / "2.md"
        version2.write_text((space.root / "rubrics" / HELPFUL / "1.md").read_text() + "\nVersion two.\n")
        (space.root / "fixed").touch()
        refused = space.score(source, out, "--chunk-size", "2", "--resume", env=env)
        assert refused.returncode == EXIT_BAD_INPUT
        assert "'helpful'" in refused.stderr and f"{HELPFUL}@1" in refused.stderr and f"{HELPFUL}@2" in refused.stderr
        assert "--restart" in refused.stderr
        assert not out.exists()
        both = space.score(source, out, "--resume", "--restart", env=env)
        assert both.returncode == EXIT_BAD_INPUT
        restarted = space.score(source, out, "--chunk-size", "2", "--restart", env=env)
        assert restarted.returncode == EXIT_OK, restarted.stderr
        refs = {r.verifier["ref"] for r in records(out) if r.verifier["kind"] == "rubric"}
        assert refs == {f"{HELPFUL}@2"}  # every row under the verifier now: none mixed in


def test_cached_verdicts_resume_as_the_same_verifier_and_an_audit_judges_again(tmp_path: Path) -> None:
    with Server.judge(default=score(3)) as judge:
        config = (f'rubrics = "rubrics"\ncache = {{ path = "verdicts.sqlite" }}\n\n[judge]\n'
                  f'base_url = "{judge.base_url}"\nmodel = "judge-test"\n')
        space = make_workspace(tmp_path, PLUGIN_ENV, config=config)
        shutil.copytree(RUBRICS, space.root / "rubrics")
        add_rubric_env(space.envs, "helpful", HELPFUL)
        items = [row(n, "helpful", prompt=f"q {n}") for n in range(4)]
        items[3] = {**row(3, PLUGIN_ENV), "task": {"n": 3, "poison": True}}  # fails until "fixed" exists
        source = write_rows(space.root / "in.jsonl", [*items, row(4, "helpful", prompt="q 4")])
        env = {"ENGINE_TEST_FIXED": str(space.root / "fixed")}
        (space.root / "fixed").touch()
        assert space.score(source, space.root / "first.jsonl", env=env).returncode == EXIT_OK  # the cache filled
        judged = len(judge.requests)
        (space.root / "fixed").unlink()
        out = space.root / "out.jsonl"
        assert space.score(source, out, "--chunk-size", "2", env=env).returncode == 1  # 2 rows checkpointed
        (space.root / "fixed").touch()
        # the checkpointed rows' provenance says "cached" (with its call's time): the same verifier as now
        resumed = space.score(source, out, "--chunk-size", "2", "--resume", env=env)
        assert resumed.returncode == EXIT_OK, resumed.stderr
        assert len(judge.requests) == judged  # every rubric row from the cache
        assert all("cached" in r.verifier for r in records(out) if r.verifier["kind"] == "rubric")
        code, data = audit_json(space, out, source, "--sample", "5", env=env)
        assert len(judge.requests) == judged + 4  # the audit reached the judge: a cached verdict proves nothing
    assert code == EXIT_OK
    rubric = next(v for v in data["verifiers"] if v["kind"] == "rubric")
    assert (rubric["compared"], rubric["equal"], rubric["provenance_changed"]) == (4, 4, 0)


def test_resume_under_the_same_verifiers_still_resumes(tmp_path: Path) -> None:
    space = make_workspace(tmp_path, PLUGIN_ENV)
    pin_config(space)
    source = write_rows(space.root / "in.jsonl", rows(6, poison=[4]))
    out = space.root / "out.jsonl"
    env = {"ENGINE_TEST_FIXED": str(space.root / "fixed")}
    assert space.score(source, out, "--chunk-size", "2", env=env).returncode == 1
    (space.root / "fixed").touch()
    resumed = space.score(source, out, "--chunk-size", "2", "--resume", env=env)
    assert resumed.returncode == EXIT_OK, resumed.stderr
    assert "resumed at row 4" in resumed.stdout


def test_diff_of_two_outputs_by_id(tmp_path: Path) -> None:
    space = make_workspace(tmp_path, PLUGIN_ENV)
    pin_config(space)
    source = write_rows(space.root / "in.jsonl", rows(10))
    first, second = space.root / "a.jsonl", space.root / "b.parquet"
    assert space.score(source, first).returncode == EXIT_OK
    assert space.score(source, second).returncode == EXIT_OK
    same = space.run("diff", first, second, "--json")
    data = orjson.loads(same.stdout)
    assert same.returncode == EXIT_OK and data["matched"] == 10 and data["verifiers"][0]["equal"] == 10
    # b's rows in another order and one reward changed: matched by id, the change found
    reordered = [orjson.loads(line) for line in first.read_bytes().splitlines()][::-1]
    reordered[0]["reward"] += 0.5
    third = space.root / "c.jsonl"
    third.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in reordered[:-1]))  # and one row left out
    changed = space.run("diff", first, third, "--by", "id", "--json")
    assert changed.returncode == EXIT_DISAGREE
    data = orjson.loads(changed.stdout)
    assert data["matched"] == 9 and data["only_a"] == 1 and data["only_b"] == 0
    (verifier,) = data["verifiers"]
    assert verifier["compared"] == 9 and verifier["equal"] == 8 and verifier["max_abs_diff"] == pytest.approx(0.5)
    report = engine.diff(first, third, tolerance=0.5)
    assert isinstance(report, engine.DiffReport) and report.agrees


def test_an_output_row_whose_id_is_not_in_the_input_is_an_error(scored: tuple[Workspace, Path, Path]) -> None:
    space, source, out = scored
    lines = out.read_bytes().splitlines()
    stray = orjson.loads(lines[0])
    stray["id"] = "not-in-the-input"
    out.write_bytes(b"\n".join([orjson.dumps(stray), *lines[1:]]) + b"\n")
    ran = space.run("audit", out, "--input", source, "--config", space.config, "--sample", "40")
    assert ran.returncode == EXIT_BAD_INPUT
    assert '"not-in-the-input"' in ran.stderr and "record 1" in ran.stderr


def test_duplicate_ids_are_matched_by_their_occurrence(tmp_path: Path) -> None:
    space = make_workspace(tmp_path, PLUGIN_ENV)
    pin_config(space)
    items = rows(6)
    for item in items:
        item["id"] = "same"  # every row the same id: each output record is its own row, in order
    source = write_rows(space.root / "in.jsonl", items)
    out = space.root / "out.jsonl"
    assert space.score(source, out).returncode == EXIT_OK
    code, data = audit_json(space, out, source, "--sample", "6")
    assert code == EXIT_OK and data["verifiers"][0]["equal"] == 6


def test_a_truncated_last_line_is_named(scored: tuple[Workspace, Path, Path]) -> None:
    space, source, out = scored
    out.write_bytes(out.read_bytes()[:-20])
    ran = space.run("audit", out, "--input", source, "--config", space.config)
    assert ran.returncode == EXIT_BAD_INPUT
    assert "line 40" in ran.stderr and "not a record" in ran.stderr


def test_a_sample_larger_than_the_output_takes_every_row(scored: tuple[Workspace, Path, Path]) -> None:
    space, source, out = scored
    code, data = audit_json(space, out, source, "--sample", "1000")
    assert code == EXIT_OK and data["sampled"] == 40 and data["verifiers"][0]["compared"] == 40
    both = space.run("audit", out, "--input", source, "--config", space.config, "--sample", "2", "--fraction", "0.1")
    assert both.returncode == EXIT_BAD_INPUT


def test_a_ray_output_directory_is_read_in_row_order(tmp_path: Path) -> None:
    # a --ray output's layout, as its parts are named: an audit reads them in row order, not name order
    space = make_workspace(tmp_path, PLUGIN_ENV)
    pin_config(space)
    source = write_rows(space.root / "in.jsonl", rows(12))
    single = space.root / "single.parquet"
    assert space.score(source, single).returncode == EXIT_OK
    table = pq.read_table(single)
    outdir = space.root / "ray-out"
    outdir.mkdir()
    for first, end in ((0, 2), (2, 10), (10, 12)):
        pq.write_table(table.slice(first, end - first), outdir / f"part-{first}-{end}.parquet")
    not_done = space.run("audit", outdir, "--input", source, "--config", space.config)
    assert not_done.returncode == EXIT_BAD_INPUT and "_SUCCESS" in not_done.stderr
    (outdir / "_SUCCESS").touch()
    code, data = audit_json(space, outdir, source, "--sample", "12")
    assert code == EXIT_OK and data["rows"] == 12 and data["verifiers"][0]["equal"] == 12
    assert engine.diff(single, outdir, by="position").verifiers[0].equal == 12


def test_a_reordered_output_is_matched_by_id_and_a_repeated_id_out_of_its_row_is_refused(tmp_path: Path) -> None:
    space = make_workspace(tmp_path, PLUGIN_ENV)
    pin_config(space)
    items = rows(8)
    items[6]["id"] = items[7]["id"] = "twice"
    source = write_rows(space.root / "in.parquet", items)  # a Parquet input: only the sampled rows decoded
    out = space.root / "out.jsonl"
    assert space.score(source, out).returncode == EXIT_OK
    lines = out.read_bytes().splitlines()
    reordered = space.root / "reordered.jsonl"
    reordered.write_bytes(b"\n".join([*lines[:6][::-1], *lines[6:]]) + b"\n")  # no record at its row but "twice"
    code, data = audit_json(space, reordered, source, "--sample", "8")
    assert code == EXIT_OK and data["verifiers"][0]["equal"] == 8  # each found by its id, none compared wrongly
    swapped = space.root / "swapped.jsonl"
    swapped.write_bytes(b"\n".join([lines[6], *lines[:6], lines[7]]) + b"\n")  # "twice" now at row 1
    ran = space.run("audit", swapped, "--input", source, "--config", space.config, "--sample", "8")
    assert ran.returncode == EXIT_BAD_INPUT
    assert '"twice"' in ran.stderr and "2 times" in ran.stderr and "record 1" in ran.stderr, ran.stderr


def test_only_the_sampled_records_and_rows_are_decoded(scored: tuple[Workspace, Path, Path]) -> None:
    # a broken record or input row the sample does not reach costs nothing and changes nothing: neither is read
    space, source, out = scored
    lines = out.read_bytes().splitlines()
    drawn = sorted(random.Random(5).sample(range(1, 41), 4))
    spare = next(n for n in range(1, 41) if n not in drawn)
    lines[spare - 1] = b"{not json"
    out.write_bytes(b"\n".join(lines) + b"\n")
    inputs = source.read_bytes().splitlines()
    inputs[spare - 1] = b"{not json either"
    source.write_bytes(b"\n".join(inputs) + b"\n")
    code, data = audit_json(space, out, source, "--sample", "4", "--seed", "5")
    assert code == EXIT_OK and data["rows"] == 40 and data["verifiers"][0]["equal"] == 4
