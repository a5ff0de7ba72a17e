"""``engine bench``: per-verifier figures from scoring a file, nothing written, errors still errors.

The figures are checked against workloads whose true rates are known: plugins that sleep a known
time under a known concurrency, and a judge slower than the rubric's concurrency lets through.
Bounds are wide (a loaded 2-core machine): physical limits (a 20 ms sleep is never shorter) and ratios.
"""

from __future__ import annotations

import asyncio
import itertools
import math
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


def test_bench_table_on_stdout(tmp_path: Path) -> None:
    space = make_workspace(tmp_path, PLUGIN_ENV)
    inp = write_rows(space.root / "in.jsonl", rows(100))
    result = space.run("bench", inp, "--config", space.config, "--repeat", "2")
    assert result.returncode == EXIT_OK, result.stderr
    assert "median of 2 run(s) (min " in result.stdout
    for column in ("items/s", "p50 ms", "p95 ms", "p99 ms", "peak in flight", "retries", "waiting", "in verifier"):
        assert column in result.stdout
    assert "waiting (summed)" in result.stdout and "in verifier (summed)" in result.stdout  # not wall time
    assert "start-up (summed)" in result.stdout and "active s" in result.stdout
    assert f"{PLUGIN_ENV}/verify:score" in result.stdout
    runs = result.stdout.split("runs: ")[1].split(", ")
    assert len(runs) == 2 and all(float(r.replace(",", "")) > 0 for r in runs)


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
    """A plugin whose import takes 0.5 s: the time its first calls spent on it is start-up, measured, and
    no call's latency; every call, those first ones too, is in the percentiles and the histogram."""
    space = make_workspace(tmp_path)
    slow = add_sleeper(space, "slow", 0.02, import_seconds=0.5)
    space.write_config('[refs."slow/verify:score"]\nmax_concurrency = 2\n')
    inp = write_rows(space.root / "in.jsonl", [row(n, slow) for n in range(60)])

    result = space.run("bench", inp, "--config", space.config, "--json", "--repeat", "2", "--batch-size", "20")

    assert result.returncode == EXIT_OK, result.stderr
    v = by_verifier(orjson.loads(result.stdout))["slow/verify:score"]
    startup, latency = v["startup"], v["latency_ms"]
    (imported,) = imports_of(space, slow)  # >= 0.5 s: the plugin's own measure of its import
    assert sum(bucket["items"] for bucket in v["histogram"]) == 2 * 60  # every item of both runs
    # the first calls' latency holds no import
    assert 19 <= latency["p50"] <= latency["p95"] <= latency["p99"] < imported * 1e3
    assert 1 <= startup["calls"] <= 2  # the first wave's (2 at once) waited for the import, once in the benchmark
    assert startup["max_ms"] >= imported * 1e3 and startup["seconds"] >= imported  # the import's time, all of it
    # Nor is the import time in the verifier: no call is in it while the module runs, and at most 2 are at
    # once, so both runs' time in it is at most 2 x (their active spans less the import)
    assert v["in_verifier_s"] <= 2 * (2 * v["active_s"]["median"] - imported)


def test_a_process_workers_spawn_is_start_up(tmp_path: Path) -> None:
    """A process plugin whose import takes 0.5 s in each of its 2 workers: their spawn, until the plugin is
    imported, is start-up (a call per worker paid it); no call's latency holds it, every item is counted."""
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
    assert sum(bucket["items"] for bucket in v["histogram"]) == 2 * 40  # every item of both runs
    assert 19 <= latency["p50"] <= latency["p95"] <= latency["p99"] < min(imported) * 1e3
    assert 1 <= startup["calls"] <= 2  # the 2 workers' spawns (and the digest check) in the first wave only
    # a worker's import, inside its spawn
    assert startup["max_ms"] >= max(imported) * 1e3 and startup["seconds"] >= max(imported)


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
    assert sum(b["items"] for b in buckets) == 80 - v["startup"]["calls"]
    for low, high in itertools.pairwise(buckets):  # contiguous, each sqrt(2) wide
        assert low["high_ms"] == high["low_ms"]
        assert math.isclose(low["high_ms"] / low["low_ms"], math.sqrt(2))
    # the two modes in buckets apart (one starting under 30 ms ends under 43 ms): every slow item (none is under
    # 60 ms) above 60 ms, and most fast ones under 30 ms (the first wave, start-up, may hold some of either)
    startup = v["startup"]["calls"]
    assert sum(b["items"] for b in buckets if b["high_ms"] > 60) >= 40 - startup
    assert sum(b["items"] for b in buckets if b["low_ms"] < 30) >= 40 // 2 - startup
    assert table.returncode == EXIT_OK, table.stderr
    assert f"latency per item after start-up, endpoint {server.url}/score:" in table.stdout
    assert "█" in table.stdout and " ms" in table.stdout


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
