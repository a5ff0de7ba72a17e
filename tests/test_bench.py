"""``engine bench``: per-verifier figures from scoring a file, nothing written, errors still errors."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import orjson
from cli_support import PLUGIN_ENV, make_workspace, rows, write_rows
from conftest import add_endpoint_env
from servers import Request, Response, Server

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
    assert "median of 2 run(s)" in result.stdout
    for column in ("items/s", "p50 ms", "p95 ms", "p99 ms", "peak in flight", "retries", "waiting", "in verifier"):
        assert column in result.stdout
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
