"""``engine bench``: per-verifier figures from scoring a file, nothing written, errors still errors.

The figures are checked against workloads whose true rates are known: plugins that sleep a known
time under a known concurrency, and a judge slower than the rubric's concurrency lets through.
Bounds are wide (a loaded 2-core machine): physical limits (a 20 ms sleep is never shorter) and ratios.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import re
import shutil
import statistics
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from cli_support import PLUGIN_ENV, RUBRICS, Ran, Workspace, make_workspace, row, rows, write_rows
from conftest import SPIN, add_endpoint_env, add_env, add_rubric_env, process_twin
from servers import Request, Response, Server, score
from test_cli import exited, squeezed, table_rows

from engine._backfill.bench import BenchRun, summarise
from engine._cli.render import bench_table, stdout
from engine._core.report import VerifierTotals
from engine._verifiers.plugin.launcher import default_workers
from engine.cli import EXIT_OK, EXIT_VERIFICATION


def test_bench_reports_each_verifier_and_writes_nothing(tmp_path: Path) -> None:
    refusals = itertools.count()

    async def endpoint(request: Request) -> Response:
        if next(refusals) < 3:  # three 503s: retried, and counted
            return Response.json({"error": "busy"}, status=503, headers={"retry-after": "0"})
        await asyncio.sleep(0.002)
        return Response.json({"reward": 0.5})

    with Server(endpoint) as server:
        space = make_workspace(tmp_path, PLUGIN_ENV)
        add_endpoint_env(space.envs, "remote", f"{server.url}/score")
        space.write_config(f'[refs."{server.url}/score"]\nmax_concurrency = 3\n')
        items = rows(300) + [dict(r, environment="remote") for r in rows(60)]
        inp = write_rows(space.root / "in.jsonl", items)
        before = sorted(p.name for p in space.root.iterdir())

        result = space.run("bench", inp, "--config", space.config, "--batch-size", "50", "--json")

    assert result.returncode == EXIT_OK, result.stderr
    assert sorted(p.name for p in space.root.iterdir()) == before  # no rewards file, no state
    summary = orjson.loads(result.stdout)
    assert summary["runs"] == 1 and summary["items"] == 360
    assert len(summary["items_per_s"]["each"]) == 1 and summary["items_per_s"]["median"] > 0
    by_kind = {v["kind"]: v for v in summary["verifiers"]}
    plugin, remote = by_kind["plugin"], by_kind["endpoint"]
    assert (plugin["verifier"], plugin["items"]) == (f"{PLUGIN_ENV}/verify:score", 300)
    assert (remote["verifier"], remote["items"]) == (f"{server.url}/score", 60)
    assert 1 <= remote["peak_in_flight"] <= 3  # the configured limit held
    assert server.max_in_flight <= 3
    assert remote["mean_reward"] == 0.5
    assert remote["retries"] == 3
    lat = remote["latency_ms"]
    assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"]
    assert remote["in_verifier_s"] > 0 and 0 <= remote["waiting_share"] <= 1


NARROW = ["kind", "verifier", "items", "items/s", "active", "p50", "p99"]
WIDE = ["kind", "verifier", "items", "items/s", "min-max", "active", "start-up", "p50", "p95", "p99", "peak in flight",
        "mean in flight", "queued", "retries"]


def header(out: str) -> list[str]:
    """The bench table's header cells; the test fails if the header takes more than one line (a word broken)."""
    lines = [line for line in out.splitlines() if line.lstrip().startswith("┃")]
    assert len(lines) == 1, out
    return table_rows(lines[0])[0]


def cells_of(out: str, verifier: str) -> list[str]:
    """The cells of the bench table's row of ``verifier``."""
    found = [cells for cells in table_rows(out) if len(cells) > 1 and cells[1] == verifier]
    assert found, out
    return found[0]


def test_bench_table_on_stdout(tmp_path: Path) -> None:
    space = make_workspace(tmp_path, PLUGIN_ENV)
    inp = write_rows(space.root / "in.jsonl", rows(100))
    result = space.run("bench", inp, "--config", space.config, "--repeat", "2")
    assert result.returncode == EXIT_OK, result.stderr
    assert "median of 2 run(s) (min " in result.stdout
    assert header(result.stdout) == NARROW
    assert "2 runs of 100 items" in result.stdout and "count all 2 runs" in result.stdout  # one unit, said
    cells = cells_of(result.stdout, f"{PLUGIN_ENV}/verify:score")
    assert cells[0] == "plugin" and cells[2] == "200"  # both runs' items, as the histogram's
    assert f"bottleneck: plugin {PLUGIN_ENV}/verify:score: " in result.stdout  # the only one
    runs = result.stdout.split("runs: ")[1].split(", ")
    assert len(runs) == 2 and all(float(r.replace(",", "")) > 0 for r in runs)

    wide = space.run("bench", inp, "--config", space.config, "--repeat", "2", "--wide")
    assert wide.returncode == EXIT_OK, wide.stderr
    assert header(wide.stdout) == WIDE
    cells = cells_of(wide.stdout, f"{PLUGIN_ENV}/verify:score")
    assert cells[2] == "200" and cells[-1] == "0"  # items of both runs; no retries
    assert re.fullmatch(r"\d+%", cells[WIDE.index("queued")])  # a share of its calls' time, never a sum over them


def test_the_default_table_fits_100_columns_and_names_the_bottleneck(tmp_path: Path) -> None:
    """At COLUMNS=100, as a user's terminal or log may be: no line is wider, the header is one line of
    whole words, and a long verifier name folds in its cell. Of two plugins, 20 ms calls 2 at a time
    (0.6 s for 60 items) and 5 ms calls 4 at a time (0.15 s for 120), the slow one bounds the batches,
    and one line says so and why: its items queued for its 2 slots (one waits ~15 calls' time)."""
    space = make_workspace(tmp_path)
    slow, fast = add_sleeper(space, "slow", 0.02), add_sleeper(space, "fast_" + "x" * 60, 0.005)
    space.write_config(
        f'[refs."slow/verify:score"]\nmax_concurrency = 2\n[refs."{fast}/verify:score"]\nmax_concurrency = 4\n'
    )
    inp = write_rows(space.root / "in.jsonl", [row(n, slow) for n in range(60)] + [row(n, fast) for n in range(120)])

    code, out, err = exited(space.start("bench", inp, "--config", space.config, env={"COLUMNS": "100"}))

    assert code == EXIT_OK, err
    assert max(map(len, out.splitlines())) <= 100, out
    assert header(out) == NARROW
    assert fast in "".join(cells[1] for cells in table_rows(out) if cells[0] in ("plugin", "")), out  # folded
    said = [line for line in out.splitlines() if line.startswith("bottleneck: ")]
    assert len(said) == 1 and said[0].startswith("bottleneck: plugin slow/verify:score: active longest, "), out
    assert squeezed("queued for a limit") in squeezed(out), out
    assert squeezed(f"the next, plugin {fast}/verify:score") in squeezed(out), out

    as_json = space.run("bench", inp, "--config", space.config, "--json")
    assert as_json.returncode == EXIT_OK, as_json.stderr
    summary = orjson.loads(as_json.stdout)
    figures = by_verifier(summary)
    s, f = figures["slow/verify:score"], figures[f"{fast}/verify:score"]
    slowest = summary["bottleneck"]
    assert (slowest["kind"], slowest["verifier"]) == ("plugin", "slow/verify:score")
    assert slowest["active_s"] == s["active_s_all_runs"] > f["active_s_all_runs"]
    assert 0 < slowest["share"] <= 1 and slowest["active_s"] <= summary["scoring_s_all_runs"]
    assert s["waiting_share"] >= 0.5  # 60 items through 2 slots: most of their time queued


def test_a_rate_over_too_short_a_span_is_flagged(tmp_path: Path) -> None:
    """5 items of a cheap plugin are a wave, not a rate: its items/s is starred and a line says why. 120
    sleeps of 20 ms, 4 at a time (>= 0.6 s of activity, physically), are a rate: no star, no warning."""
    space = make_workspace(tmp_path, PLUGIN_ENV)
    steady = add_sleeper(space, "steady", 0.02)
    space.write_config('[refs."steady/verify:score"]\nmax_concurrency = 4\n')
    inp = write_rows(space.root / "in.jsonl", rows(5) + [row(n, steady) for n in range(120)])

    table = space.run("bench", inp, "--config", space.config)
    as_json = space.run("bench", inp, "--config", space.config, "--json")

    assert table.returncode == as_json.returncode == EXIT_OK, table.stderr + as_json.stderr
    warned = [line for line in table.stdout.splitlines() if line.startswith("* ")]
    assert len(warned) == 1, table.stdout
    assert warned[0].startswith(f"* plugin {PLUGIN_ENV}/verify:score: too short to measure a rate: active ")
    assert warned[0].endswith(" over 5 items a run, under 100 ms or 100 items; bench a larger file")
    assert cells_of(table.stdout, f"{PLUGIN_ENV}/verify:score")[3].endswith("*")
    assert not cells_of(table.stdout, "steady/verify:score")[3].endswith("*")
    figures = by_verifier(orjson.loads(as_json.stdout))
    assert figures[f"{PLUGIN_ENV}/verify:score"]["short_span"] is True
    assert figures["steady/verify:score"]["short_span"] is False
    assert figures["steady/verify:score"]["active_s"]["median"] >= 30 * 0.02 * 0.95


def test_a_broken_verifier_fails_the_benchmark(tmp_path: Path) -> None:
    space = make_workspace(tmp_path, PLUGIN_ENV)
    inp = write_rows(space.root / "in.jsonl", rows(100, poison=[42]))
    result = space.run("bench", inp, "--config", space.config, "--json")
    assert result.returncode == EXIT_VERIFICATION
    assert result.stdout == ""  # no figures for a broken verifier: a fast zero is not a result
    assert "plugin verifier 'verify:score'" in result.stderr and "row-0042" in result.stderr
    assert f"input: {inp}, line 43" in result.stderr  # located in the file as engine score locates it


def add_sleeper(space: Workspace, name: str, seconds: float, *, import_seconds: float = 0.0) -> str:
    """A plugin environment whose every call sleeps ``seconds`` (its import ``import_seconds``) and returns 1.

    Each import of it adds how long it took, in seconds, as a line of ``imports_of(space, name)``."""
    add_env(space.envs, name, "plugin", "verify:score")
    (space.envs / name / "verify.py").write_text(
        f"import time\n_began = time.monotonic()\ntime.sleep({import_seconds})\n"
        f"with open({str(imports_log(space, name))!r}, 'a') as _log:\n"
        "    _log.write(f'{time.monotonic() - _began}\\n')\n\n\n"
        f"def score(task, trajectory):\n    time.sleep({seconds})\n    return 1.0\n"
    )
    return name


def imports_log(space: Workspace, name: str) -> Path:
    return space.root / f"{name}.imports"


def imports_of(space: Workspace, name: str) -> list[float]:
    """How long each import of :func:`add_sleeper`'s plugin ``name`` took, as the plugin measured it."""
    return [float(line) for line in imports_log(space, name).read_text().split()]


def by_verifier(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["verifier"]: v for v in summary["verifiers"]}


def test_each_verifiers_rate_is_over_its_own_active_time(tmp_path: Path) -> None:
    """Two plugins side by side: 20 ms calls, 2 at a time (100 items/s), and 5 ms calls, 4 at a time (800
    items/s). Over the whole run's time both would read alike (their item counts' ratio, 2); over each
    one's active time the fast one is many times the slow one, and the slow one is ~100/s."""
    space = make_workspace(tmp_path)
    slow, fast = add_sleeper(space, "slow", 0.02), add_sleeper(space, "fast", 0.005)
    space.write_config(
        '[refs."slow/verify:score"]\nmax_concurrency = 2\n[refs."fast/verify:score"]\nmax_concurrency = 4\n'
    )
    inp = write_rows(space.root / "in.jsonl", [row(n, slow) for n in range(60)] + [row(n, fast) for n in range(120)])

    result = space.run("bench", inp, "--config", space.config, "--json")

    assert result.returncode == EXIT_OK, result.stderr
    figures = by_verifier(orjson.loads(result.stdout))
    s, f = figures["slow/verify:score"], figures["fast/verify:score"]
    assert (s["items"], f["items"]) == (60, 120)
    # 60 calls of >= 20 ms, 2 at a time: at least 0.6 s of work, so at most ~100 items/s
    assert s["active_s"]["median"] >= 0.6 * 0.95
    assert s["items_per_s"]["median"] <= 105
    for v, items in ((s, 60), (f, 120)):  # each one's rate is over its own active time...
        assert v["items_per_s"]["median"] == pytest.approx(items / v["active_s"]["median"])
    # ...so the fast one's is more than twice the slow one's (the true ratio is 8); over the run's time, it is 2
    assert f["items_per_s"]["median"] > 2 * s["items_per_s"]["median"]
    assert f["active_s"]["median"] < s["active_s"]["median"]
    for v in (s, f):
        assert v["items_per_s"]["min"] == v["items_per_s"]["median"] == v["items_per_s"]["max"]  # one run


def test_start_up_is_reported_apart_from_steady_state_latency(tmp_path: Path) -> None:
    """A plugin whose import takes 0.5 s: the time its first calls spent on it is start-up, measured; those
    calls are start-up's, in neither the percentiles nor the histogram, which hold every other item."""
    space = make_workspace(tmp_path)
    slow = add_sleeper(space, "slow", 0.02, import_seconds=0.5)
    space.write_config('[refs."slow/verify:score"]\nmax_concurrency = 2\n')
    inp = write_rows(space.root / "in.jsonl", [row(n, slow) for n in range(60)])

    result = space.run("bench", inp, "--config", space.config, "--json", "--repeat", "2", "--batch-size", "20")

    assert result.returncode == EXIT_OK, result.stderr
    v = by_verifier(orjson.loads(result.stdout))["slow/verify:score"]
    startup, latency = v["startup"], v["latency_ms"]
    (imported,) = imports_of(space, slow)  # >= 0.5 s: the plugin's own measure of its import
    assert 1 <= startup["calls"] <= 2  # the first wave's (2 at once) waited for the import, once in the benchmark
    assert startup["items"] == startup["calls"]  # a call an item, until calls are measured
    assert sum(bucket["items"] for bucket in v["histogram"]) == 2 * 60 - startup["items"]  # every other item
    assert v["items_all_runs"] == 2 * 60 and v["items"] == 60
    # no percentile holds the import
    assert 19 <= latency["p50"] <= latency["p95"] <= latency["p99"] < imported * 1e3
    assert startup["max_ms"] >= imported * 1e3 and startup["seconds"] >= imported  # the import's time, all of it
    # Nor is the import time in the verifier: no call is in it while the module runs, and at most 2 are at
    # once, so both runs' time in it is at most 2 x (their active spans less the import)
    assert v["in_verifier_s"] <= 2 * (2 * v["active_s"]["median"] - imported)


def test_a_process_workers_spawn_is_start_up(tmp_path: Path) -> None:
    """A process plugin whose import takes 0.5 s in each of its 2 workers: their spawn, until the plugin is
    imported, is start-up (a call per worker paid it); the calls that waited on it are start-up's too, in no
    latency; every other item is in the histogram."""
    space = make_workspace(tmp_path)
    slow = process_twin(space.envs, add_sleeper(space, "slow", 0.02, import_seconds=0.5), workers=2)
    space.write_config(f'[refs."{slow}/verify:score"]\nmax_concurrency = 2\n')
    inp = write_rows(space.root / "in.jsonl", [row(n, slow) for n in range(40)])

    result = space.run("bench", inp, "--config", space.config, "--json", "--repeat", "2", "--batch-size", "20")

    assert result.returncode == EXIT_OK, result.stderr
    v = by_verifier(orjson.loads(result.stdout))[f"{slow}/verify:score"]
    startup, latency = v["startup"], v["latency_ms"]
    imported = imports_of(space, "slow")  # each worker's import, >= 0.5 s, as the plugin measured it
    assert len(imported) == 2
    assert 1 <= startup["calls"] <= 2  # the 2 workers' spawns (and the digest check) in the first wave only
    assert startup["items"] >= startup["calls"]
    assert sum(bucket["items"] for bucket in v["histogram"]) == 2 * 40 - startup["items"]  # every other item
    assert 19 <= latency["p50"] <= latency["p95"] <= latency["p99"] < min(imported) * 1e3
    # a worker's import, inside its spawn
    assert startup["max_ms"] >= max(imported) * 1e3 and startup["seconds"] >= max(imported)


def test_calls_that_waited_on_start_up_are_not_in_the_percentiles(tmp_path: Path) -> None:
    """A plugin of microsecond calls whose import takes 0.5 s, called 64 at a time: its first wave of calls
    waits on the one import. Those calls are start-up, their items counted apart; the percentiles are
    the other items', so even its p99 is under the import (the issue's JSON parse read 83 ms at p95)."""
    space = make_workspace(tmp_path)
    quick = add_sleeper(space, "quick", 0.0, import_seconds=0.5)
    space.write_config('[refs."quick/verify:score"]\nmax_concurrency = 64\n')
    inp = write_rows(space.root / "in.jsonl", [row(n, quick) for n in range(2_000)])

    result = space.run("bench", inp, "--config", space.config, "--json")

    assert result.returncode == EXIT_OK, result.stderr
    v = by_verifier(orjson.loads(result.stdout))["quick/verify:score"]
    startup, latency = v["startup"], v["latency_ms"]
    (imported,) = imports_of(space, quick)
    assert 2 <= startup["calls"] <= 64  # the first wave: every call started before the import ended
    assert startup["items"] == startup["calls"]  # a call an item until calls are measured
    assert sum(bucket["items"] for bucket in v["histogram"]) == 2_000 - startup["items"]
    assert startup["max_ms"] >= imported * 1e3
    assert latency["p50"] <= latency["p95"] <= latency["p99"] < imported * 1e3


def test_the_table_and_the_histogram_count_the_same_items(tmp_path: Path) -> None:
    """Two runs of 60 items of a plugin whose import takes 0.5 s: the header says what the counts are over,
    and the table's items, the histogram's and the start-up calls' are all over both runs, and add up."""
    space = make_workspace(tmp_path)
    slow = add_sleeper(space, "slow", 0.02, import_seconds=0.5)
    space.write_config('[refs."slow/verify:score"]\nmax_concurrency = 2\n')
    inp = write_rows(space.root / "in.jsonl", [row(n, slow) for n in range(60)])

    result = space.run("bench", inp, "--config", space.config, "--repeat", "2", "--batch-size", "20")

    assert result.returncode == EXIT_OK, result.stderr
    out = result.stdout
    assert out.startswith("2 runs of 60 items. ") and "count all 2 runs" in out
    assert cells_of(out, "slow/verify:score")[2] == "120"
    title = "latency per item, plugin slow/verify:score"
    said = re.search(rf"^{title}: (\d+) of (\d+) items \(all 2 runs\); (\d+) items in the (\d+) calls that waited "
                     "on start-up", out, re.MULTILINE)
    assert said, out
    counted, of, apart, calls = map(int, said.groups())
    assert of == 120 and counted + apart == 120 and apart == calls and 1 <= calls <= 2
    assert sum(drawn(out, title)) == counted


def test_time_queued_for_a_process_plugins_workers_is_waiting(tmp_path: Path) -> None:
    """A process plugin of 2 workers, 20 ms a call, that the scheduler may call 8 at a time: 6 calls queue for a
    worker. That is waiting, not time in the plugin: the p50 is the call's 20 ms, 2 are in flight at most."""
    space = make_workspace(tmp_path)
    slow = process_twin(space.envs, add_sleeper(space, "slow", 0.02), workers=2)
    space.write_config(f'[refs."{slow}/verify:score"]\nmax_concurrency = 8\n')
    inp = write_rows(space.root / "in.jsonl", [row(n, slow) for n in range(80)])

    result = space.run("bench", inp, "--config", space.config, "--json")

    assert result.returncode == EXIT_OK, result.stderr
    v = by_verifier(orjson.loads(result.stdout))[f"{slow}/verify:score"]
    assert 1 <= v["peak_in_flight"] <= 2  # the workers, not the 8 calls queued for them
    # a call's 20 ms, less than an item's mean wait (~3 calls': 8 held, 2 served); with the queue it would be more
    assert 19 <= v["latency_ms"]["p50"] < v["waiting_s"] / 80 * 1e3
    assert v["waiting_share"] >= 0.5  # 8 calls held, 2 served: ~3/4 of their summed time is queueing


def bench_an_endpoint(
    tmp_path: Path, endpoint: Callable[[Request], Awaitable[Response]], items: int, *runs: list[str]
) -> tuple[Server, list[Ran]]:
    """``engine bench`` over ``items`` rows of one endpoint (max_concurrency 4) served by ``endpoint``, once per
    list of extra arguments in ``runs``; the server, to ask what it saw, and each run's result."""
    with Server(endpoint) as server:
        space = make_workspace(tmp_path)
        add_endpoint_env(space.envs, "remote", f"{server.url}/score")
        space.write_config(f'[refs."{server.url}/score"]\nmax_concurrency = 4\n')
        inp = write_rows(space.root / "in.jsonl", [row(n, "remote") for n in range(items)])
        return server, [space.run("bench", inp, "--config", space.config, *extra) for extra in runs]


def test_time_queued_behind_a_verifiers_own_limit_is_waiting(tmp_path: Path) -> None:
    """An endpoint of 30 ms a call, max_concurrency 4, 40 items: the lane's 4 workers take them in 10 waves, and
    the items of wave k waited k calls' time from the batch's start. Per call, as busy is: waiting is
    4 x (0+1+...+9) = 180 call times, busy 40, so waiting is 4.5 times busy and ~82% of their sum."""

    async def endpoint(request: Request) -> Response:
        await asyncio.sleep(0.03)
        return Response.json({"reward": 1.0})

    server, (result,) = bench_an_endpoint(tmp_path, endpoint, 40, ["--json"])
    assert result.returncode == EXIT_OK, result.stderr
    assert server.max_in_flight <= 4
    (v,) = orjson.loads(result.stdout)["verifiers"]
    assert v["waiting_s"] >= 180 * 0.03 * 0.95  # each wave's calls took >= 30 ms: a physical lower bound
    assert 3.5 <= v["waiting_s"] / v["in_verifier_s"] <= 8  # 4.5 if calls took alike; the gaps between them wait
    assert 0.7 <= v["waiting_share"] <= 0.9


JUDGE_USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}


def test_time_queued_behind_the_judges_limit_is_waiting(tmp_path: Path) -> None:
    """The rubric may have 8 calls in flight, the judge only 2: six wait, and the bench says so, as waiting;
    the peak in flight is what the judge really had; its token usage is counted."""

    async def slow_judge(request: Request) -> Response:
        await asyncio.sleep(0.03)
        return score(4, usage=JUDGE_USAGE)

    with Server.judge(default=slow_judge) as judge:
        config = (
            f'rubrics = "rubrics"\n[judge]\nbase_url = "{judge.base_url}"\nmodel = "judge-test"\n'
            'max_concurrency = 2\n[refs."bob/helpfulness"]\nmax_concurrency = 8\n'
        )
        space = make_workspace(tmp_path, config=config)
        shutil.copytree(RUBRICS, space.root / "rubrics")
        add_rubric_env(space.envs, "helpful", "bob/helpfulness")
        inp = write_rows(space.root / "in.jsonl", [row(n, "helpful", prompt=f"question {n}") for n in range(40)])

        result = space.run("bench", inp, "--config", space.config, "--json")

    assert result.returncode == EXIT_OK, result.stderr
    assert judge.max_in_flight <= 2
    summary = orjson.loads(result.stdout)
    (v,) = summary["verifiers"]
    assert v["kind"] == "rubric" and v["items"] == 40
    assert 1 <= v["peak_in_flight"] <= 2  # not the 8 the rubric's limit let into the judge's queue
    # 8 calls held, 2 judged: ~3/4 of the summed time is queueing (wide: start-up and jitter)
    assert v["waiting_share"] >= 0.5
    assert v["waiting_s"] > v["in_verifier_s"]
    assert v["latency_ms"]["p50"] >= 30 * 0.95  # time judging: the judge's 30 ms, not the queue too...
    assert v["latency_ms"]["p50"] < v["waiting_s"] / 40 * 1e3  # ...less than an item's mean wait (~3 calls')
    usage = {"requests": 40, "retries": 0, **{name: 40 * count for name, count in JUDGE_USAGE.items()}}
    assert v["judge_usage"] == usage and summary["judge_usage"] == usage


def test_runs_are_summarised_by_min_median_and_max(tmp_path: Path) -> None:
    space = make_workspace(tmp_path, PLUGIN_ENV)
    inp = write_rows(space.root / "in.jsonl", rows(100))
    result = space.run("bench", inp, "--config", space.config, "--repeat", "2", "--json")
    assert result.returncode == EXIT_OK, result.stderr
    rate = orjson.loads(result.stdout)["items_per_s"]
    assert len(rate["each"]) == 2
    assert rate["median"] == statistics.median(rate["each"])  # of two runs: their mean, not the higher one
    assert (rate["min"], rate["max"]) == (min(rate["each"]), max(rate["each"]))


def test_latency_histogram_shows_two_modes(tmp_path: Path) -> None:
    """An endpoint answering half its items in ~5 ms and half in >= 60 ms: the histogram's log-scaled
    buckets hold the two modes apart, in the JSON and drawn in the terminal."""

    async def endpoint(request: Request) -> Response:
        await asyncio.sleep(0.06 if request.json()["task"]["n"] % 2 else 0.005)
        return Response.json({"reward": 1.0})

    server, (as_json, table) = bench_an_endpoint(tmp_path, endpoint, 80, ["--json"], [])

    assert as_json.returncode == EXIT_OK, as_json.stderr
    (v,) = orjson.loads(as_json.stdout)["verifiers"]
    buckets = v["histogram"]
    assert sum(b["items"] for b in buckets) == 80 - v["startup"]["items"]
    for low, high in itertools.pairwise(buckets):  # contiguous, each sqrt(2) wide
        assert low["high_ms"] == high["low_ms"]
        assert math.isclose(low["high_ms"] / low["low_ms"], math.sqrt(2))
    # the two modes in buckets apart (one starting under 30 ms ends under 43 ms): every slow item (none is under
    # 60 ms) above 60 ms, and most fast ones under 30 ms (the first wave, start-up, may hold some of either)
    startup = v["startup"]["calls"]
    assert sum(b["items"] for b in buckets if b["high_ms"] > 60) >= 40 - startup
    assert sum(b["items"] for b in buckets if b["low_ms"] < 30) >= 40 // 2 - startup
    assert table.returncode == EXIT_OK, table.stderr
    title = f"latency per item, endpoint {server.url}/score"
    counted = re.search(rf"^{re.escape(title)}: (\d+) of 80 items \(the one run\)", table.stdout, re.MULTILINE)
    assert counted, table.stdout
    # a row for each bucket that holds items, none for an empty one: the rows add up to the items counted
    rows_drawn = drawn(table.stdout, title)
    assert all(rows_drawn) and sum(rows_drawn) == int(counted[1]), table.stdout


def drawn(out: str, title: str) -> list[int]:
    """The item counts of the histogram under the line starting with ``title`` (its rows, in order)."""
    lines = iter(out.splitlines()[next(n for n, line in enumerate(out.splitlines()) if line.startswith(title)):])
    for line in lines:  # the title, wrapped or not, ends with a colon
        if line.endswith(":"):
            break
    counts = []
    for line in lines:
        if not (found := re.search(r"  ([\d,]+) \(\d+%\)$", line)):
            break
        counts.append(int(found[1].replace(",", "")))
    return counts


def test_the_histogram_draws_only_the_buckets_that_hold_items() -> None:
    """Items at 10 us and at 1 s: two rows, each with its range, and none for the 32 empty buckets between."""
    totals = VerifierTotals("plugin", "verify:score", items=5, active=1.0, busy=3.0)
    totals.latency.extend([10e-6, 1.0], [3, 2])
    summary = summarise([BenchRun(5, 1.0, 1.0, {"env/verify:score": totals})])
    assert len(summary["verifiers"][0]["histogram"]) > 20  # the JSON keeps every bucket, empty ones too
    with stdout.capture() as captured:
        bench_table(summary)
    out = captured.get()
    assert drawn(out, "latency per item, plugin env/verify:score: 5 of 5 items (the one run)") == [3, 2], out
    assert re.search(r"^ *8\.00-11\.3 us +█+ +3 \(60%\)$", out, re.MULTILINE), out  # each row its bounds
    assert re.search(r"^ *741 ms-1\.05 s +█+ +2 \(40%\)$", out, re.MULTILINE), out


def add_spinner(space: Workspace, name: str = "spin") -> str:
    add_env(space.envs, name, "plugin", "verify:score")
    (space.envs / name / "verify.py").write_text(SPIN)
    return name


@pytest.mark.skipif(default_workers() < 2, reason="worker processes gain nothing on one core: no hint")
def test_bench_says_when_a_cpu_bound_thread_plugin_would_use_every_core(tmp_path: Path) -> None:
    """The engine does not switch executors by itself; bench says when a thread plugin would gain from processes.

    Not for a cheap plugin (a worker's round trip would be much of its call), one that waits (a sleep),
    nor one that already runs in processes.
    """
    space = make_workspace(tmp_path, PLUGIN_ENV)  # the cheap one
    spin = add_spinner(space)
    twin = process_twin(space.envs, spin, workers=1)
    sleepy = add_sleeper(space, "sleepy", 0.005)
    items = rows(300) + [dict(r, environment=name) for name in (spin, twin, sleepy) for r in rows(60)]
    inp = write_rows(space.root / "in.jsonl", items)

    # The spinner is CPU-bound by the share of its calls' time on a CPU: a machine loaded past its cores
    # gives it less, and then no hint is the right answer. So up to three runs, until one measures it so;
    # the others must never get one.
    for _ in range(3):
        result = space.run("bench", inp, "--config", space.config, "--json")
        assert result.returncode == EXIT_OK, result.stderr
        hints = {v["verifier"]: v["process_hint"] for v in orjson.loads(result.stdout)["verifiers"]}
        hint = hints.pop(f"{spin}/verify:score")
        assert hints == {f"{PLUGIN_ENV}/verify:score": None, f"{twin}/verify:score": None,
                         f"{sleepy}/verify:score": None}
        if hint is not None:
            break
    assert hint is not None and hint["cores"] == default_workers()
    assert hint["cpu_share"] > 0.5 and hint["call_ms"] >= 0.05
    assert f'"executor": "process" in its manifest\'s verifier would use {default_workers()} cores' in hint["says"]

    for _ in range(3):
        table = space.run("bench", inp, "--config", space.config)
        assert table.returncode == EXIT_OK, table.stderr
        said = [line for line in table.stdout.splitlines() if line.startswith("hint: ")]
        assert all(line.startswith(f"hint: plugin {spin}/verify:score: CPU-bound (") for line in said), table.stdout
        if said:
            break
    assert len(said) == 1, table.stdout
