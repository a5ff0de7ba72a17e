"""A judge behind a quota: the adaptive window against today's fixed concurrency and a verl-style semaphore.

The judge server runs in a subprocess (its own loop): a token bucket of ``Q`` requests a second (capacity
``Q / 4``: a quarter second's burst); above it, 429 with ``Retry-After`` set to the seconds until the bucket
holds a token again, as a decimal (what a token bucket knows, and what the engine parses) or rounded up to
whole seconds (what many real APIs send), else a completion after ``latency`` seconds. Each contender scores
``N`` distinct items with ``max_concurrency`` far above ``Q * latency``, in a subprocess of its own: the
adaptive engine (this checkout), the fixed one (the code before the window: ``--before`` names that checkout,
default /work/main), a semaphore around a plain httpx POST retrying 429 after its Retry-After, and two
``Engine.connect`` client processes (``N / 2`` items each) through one ``engine serve`` of this checkout.
Printed: achieved rate / Q and 429s / requests, medians of ``--repeats`` runs, alternating; ``--phases``
prints each run's 429s by when they came (on stderr).

    python benchmarks/bench_quota.py [--repeats 3] [--before /work/main] [--phases]
    # BENCH_ONLY="adaptive;fixed": those contenders alone; BENCH_ROW=0: the first setting alone
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
Setting = tuple[float, float, int, int, bool]  # Q, latency s, max_concurrency, items, Retry-After in whole seconds
SETTINGS: list[Setting] = [(100.0, 0.1, 128, 1200, False), (200.0, 0.05, 256, 2400, False),
                           (100.0, 0.1, 128, 1200, True)]
RUN_LIMIT = 120.0  # seconds a contender may take before it is stopped


def serve(port_file: str, quota: float, latency: float, whole: bool) -> None:
    """The quota server (subprocess): writes its port, counts 200s and 429s (each 429's time after the first
    request too: where they come from), the peak of requests in flight, and answers GET /counts."""
    counts = {"ok": 0, "throttled": 0, "in_flight": 0, "peak": 0}
    throttled_at: list[float] = []
    first: list[float] = []
    capacity = quota / 4
    tokens, last = capacity, time.monotonic()
    reply = json.dumps({"choices": [{"message": {"content": '{"score": 1, "reason": "ok"}'},
                                     "finish_reason": "stop"}]}).encode()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal tokens, last
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                if head.startswith(b"GET"):
                    body, code, extra = json.dumps({**counts, "throttled_at": throttled_at}).encode(), 200, b""
                else:
                    now = time.monotonic()
                    first[:] = first or [now]
                    tokens = min(capacity, tokens + (now - last) * quota)
                    last = now
                    if tokens >= 1:
                        tokens -= 1
                        counts["ok"] += 1
                        counts["in_flight"] += 1
                        counts["peak"] = max(counts["peak"], counts["in_flight"])
                        await asyncio.sleep(latency)
                        counts["in_flight"] -= 1
                        body, code, extra = reply, 200, b""
                    else:
                        counts["throttled"] += 1
                        throttled_at.append(now - first[0])
                        wait = (1 - tokens) / quota
                        told = f"{math.ceil(wait)}" if whole else f"{wait:.3f}"
                        body, code, extra = b'{"error": "rate"}', 429, f"retry-after: {told}\r\n".encode()
                writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
                             % (code, len(body), extra) + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        Path(port_file).write_text(str(server.sockets[0].getsockname()[1]))
        await asyncio.sleep(RUN_LIMIT * 10)

    asyncio.run(main())


def items_of(count: int, first: int = 0) -> list[dict[str, Any]]:
    """``count`` rubric items, each its own trajectory: an engine that dedups or caches verdicts (the code after
    issue 26's cache) judges every one, as the semaphore does."""
    return [{"environment": "graded", "task": {"prompt": "6*7?", "reference": "42"}, "trajectory": f"42 ({n})"}
            for n in range(first, first + count)]


def engine_run(url: str, concurrency: int, items: int, work: str) -> None:
    """A contender (subprocess): score ``items`` rubric items through the engine on the path."""
    from engine import Engine, EngineConfig, JudgeConfig

    envs, rubrics = Path(work) / "envs", Path(work) / "rubrics"
    judge = JudgeConfig(base_url=url, model="m", max_concurrency=concurrency, max_attempts=50, retry_deadline=60.0)
    config = EngineConfig(environments=envs, rubrics=rubrics, judge=judge)
    batch = items_of(items)

    async def main() -> float:
        async with Engine(config) as eng:
            started = time.monotonic()
            await eng.score(batch)
            return time.monotonic() - started

    print(json.dumps({"elapsed": asyncio.run(main())}))


def semaphore_run(url: str, concurrency: int, items: int) -> None:
    """verl's way (subprocess): an asyncio.Semaphore around a plain httpx POST, retrying 429 after Retry-After."""
    import httpx

    async def main() -> float:
        gate = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency)) as client:
            async def one() -> None:
                async with gate:
                    for _ in range(50):
                        response = await client.post(url + "/chat/completions", json={"model": "m"})
                        if response.status_code != 429:
                            return
                        await asyncio.sleep(float(response.headers.get("retry-after", "1")))

            started = time.monotonic()
            await asyncio.gather(*(one() for _ in range(items)))
            return time.monotonic() - started

    print(json.dumps({"elapsed": asyncio.run(main())}))


def clients_run(url: str, items: int, first: int) -> None:
    """A client of ``engine serve`` (subprocess): score ``items`` rubric items through ``Engine.connect``."""
    from engine import Engine

    batch = items_of(items, first)

    async def main() -> float:
        async with Engine.connect(url) as eng:
            started = time.monotonic()
            await eng.score(batch)
            return time.monotonic() - started

    print(json.dumps({"elapsed": asyncio.run(main())}))


def counts(port: int) -> dict[str, Any]:
    import httpx

    return dict(httpx.get(f"http://127.0.0.1:{port}/counts").json())


def waited_port(port_file: Path) -> int:
    deadline = time.monotonic() + 10
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline:
            raise RuntimeError("the quota server did not start")
        time.sleep(0.05)
    return int(port_file.read_text())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def through_serve(path: Path, url: str, concurrency: int, items: int, work: str) -> float:
    """Two ``Engine.connect`` clients, ``items / 2`` each at once, through one ``engine serve``: their elapsed."""
    config = Path(work) / "engine.toml"
    config.write_text(f'environments = "envs"\nrubrics = "rubrics"\n[judge]\nbase_url = "{url}"\nmodel = "m"\n'
                      f"max_concurrency = {concurrency}\nmax_attempts = 50\nretry_deadline = 60.0\n")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(path)}
    service = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--config", str(config), "--port", str(port)],
                               cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import httpx

        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or service.poll() is not None:
                raise RuntimeError("engine serve did not start")
            time.sleep(0.1)
        me = [sys.executable, str(Path(__file__).resolve()), "--client", f"http://127.0.0.1:{port}", str(items // 2)]
        started = time.monotonic()
        clients = [subprocess.Popen([*me, str(n * items)], env=env, stdout=subprocess.PIPE, text=True)
                   for n in range(2)]
        for client in clients:
            client.wait(timeout=RUN_LIMIT)
            if client.returncode:
                raise RuntimeError("a client failed")
        return time.monotonic() - started
    finally:
        service.terminate()
        service.wait()


def one_run(name: str, path: Path, setting: Setting, work: str) -> dict[str, Any]:
    """One contender against a fresh quota server: rate / Q, 429s / requests, the server's counts."""
    quota, latency, concurrency, items, whole = setting
    port_file = Path(work) / "port"
    port_file.unlink(missing_ok=True)
    server = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", str(port_file), str(quota),
                               str(latency), str(int(whole))])
    try:
        url = f"http://127.0.0.1:{waited_port(port_file)}/v1"
        env = {**os.environ, "PYTHONPATH": str(path)}
        if name == "engine serve, 2 clients":
            elapsed = through_serve(path, url, concurrency, items, work)
        else:
            me = [sys.executable, *os.environ.get("BENCH_WRAP", "").split(), str(Path(__file__).resolve())]
            command = ([*me, "--semaphore", url, str(concurrency), str(items)] if name == "semaphore"
                       else [*me, "--engine", url, str(concurrency), str(items), work])
            out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_LIMIT,
                                 check=True).stdout
            elapsed = json.loads(out.strip().splitlines()[-1])["elapsed"]
        seen = counts(int(port_file.read_text()))
    finally:
        server.kill()
        server.wait()
    requests = seen["ok"] + seen["throttled"]
    return {"rate": items / elapsed / quota, "throttled": seen["throttled"] / requests, "seen": seen}


def phases(throttled_at: list[float], latency: float) -> str:
    """The 429s by when they came: the first second (the descent from the ceiling), then each further second."""
    bins: dict[int, int] = {}
    for at in throttled_at:
        bins[int(at * 20)] = bins.get(int(at * 20), 0) + 1
    return " ".join(f"{second / 20:g}s:{n}" for second, n in sorted(bins.items()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", type=Path, default=Path("/work/main"))
    parser.add_argument("--phases", action="store_true", help="print each run's 429s by the second they came in")
    args = parser.parse_args()
    work = tempfile.mkdtemp()
    shutil.copytree(ROOT / "tests" / "rubrics", Path(work) / "rubrics")
    env_dir = Path(work) / "envs" / "graded"
    env_dir.mkdir(parents=True)
    (env_dir / "manifest.json").write_text(json.dumps(
        {"kind": "environment", "verifier": {"kind": "rubric", "ref": "alice/arithmetic-correctness@1"}}))
    paths = {"adaptive": ROOT, "fixed": args.before, "semaphore": ROOT, "engine serve, 2 clients": ROOT}
    if only := os.environ.get("BENCH_ONLY"):
        paths = {name: paths[name] for name in only.split(";")}
    settings = SETTINGS
    if row := os.environ.get("BENCH_ROW"):
        settings = [SETTINGS[int(row)]]
    print("| Q/s | latency | Retry-After | max_concurrency | items | contender | rate / Q | 429s / requests |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for setting in settings:
        quota, latency, concurrency, items, whole = setting
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, path in paths.items():
                run = one_run(name, path, setting, work)
                results[name].append(run)
                if args.phases:
                    print(f"  {name}: {run['rate']:.2f} Q, {run['throttled']:.1%}, peak in flight "
                          f"{run['seen']['peak']}; 429s {phases(run['seen']['throttled_at'], latency)}",
                          file=sys.stderr, flush=True)
        for name, runs in results.items():
            rate = statistics.median(r["rate"] for r in runs)
            throttled = statistics.median(r["throttled"] for r in runs)
            print(f"| {quota:g} | {latency * 1000:g} ms | {'whole s' if whole else 'decimal'} | {concurrency} | "
                  f"{items} | {name} | {rate:.2f} | {throttled:.1%} |", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5] == "1")
    elif sys.argv[1:2] == ["--client"]:
        clients_run(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1:2] == ["--engine"]:
        engine_run(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    elif sys.argv[1:2] == ["--semaphore"]:
        semaphore_run(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
