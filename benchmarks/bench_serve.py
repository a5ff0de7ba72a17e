"""``engine serve``: the service against its own server stack, and ``connect()`` against in-process.

1. Single-item ``POST /v1/score`` requests from 64 concurrent keep-alive connections (OpenRLHF's
   pattern) with a cheap plugin: ``engine serve``'s items/s against the same server stack
   (uvicorn, httptools, one process) answering a constant, in the same run. For the record, the
   same with the plugin's ``async def`` twin (no thread hop a batch), and the service's own layer
   over a stub engine that answers at once (what a request costs beyond the engine's batch of one).
   For the choice of the stack, the constant is also measured on uvicorn with h11 and on hypercorn.
   The service gathers the one-item requests into engine batches (``engine._serve.gather``): how many
   requests an engine batch took on average is read from its ``/metrics``.
2. One 4,096-item batch of the same plugin through ``Engine.connect()`` against the same batch
   in-process (``Engine.from_config``), one after the other, ``--repeat`` times.

The load comes from a minimal HTTP/1.1 client on asyncio in this process (one core), the servers
run in processes of their own (the other core). Each run is bounded in requests and in time; the
figures are medians over ``--repeat`` runs, and each ratio the median of the runs' ratios.

    .venv/bin/python benchmarks/bench_serve.py [--requests N] [--repeat R]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import anyio
import httpx
import orjson
from _common import free_port, machine, running, table, write_env
from prometheus_client.parser import text_string_to_metric_families

import engine

CONNECTIONS = 64
BATCH = 4096
TIME_LIMIT = 60.0  # seconds one load run may take, whatever its count
CHEAP = """\
def score(task, trajectory):
    return 1.0 if trajectory == task["reference"] else 0.0
"""
CHEAP_ASYNC = """\
async def score(task, trajectory):
    return 1.0 if trajectory == task["reference"] else 0.0
"""
# The service's own layer (its ASGI app, JSON both ways, the admission and the metrics) over an engine
# that answers at once: what the service costs a request beyond the engine's batch of one.
STUB = """\
import sys

import uvicorn

from engine._core.report import BatchResult, VerifierReport
from engine._serve.app import App
from engine._serve.limits import ServeConfig

RESULT = BatchResult([0.0], [VerifierReport("plugin", "verify:score", "cheap/verify:score",
                                            {"kind": "plugin", "ref": "verify:score", "environment": "cheap",
                                             "digest": "sha256:" + "0" * 64}, items=1, latencies=[1e-6],
                                            latency_items=[1])], 1e-4, [0])


class Plugin:
    verifier_key = "cheap/verify:score"

    class verifier:
        kind = "plugin"


class Stub:
    async def run(self, items, *, first_index=0):
        return BatchResult([0.0] * len(items), RESULT.verifiers, RESULT.elapsed, [0] * len(items))

    def environment(self, name):
        return Plugin


port = int(sys.argv[1])
uvicorn.run(App(Stub(), ServeConfig(port=port)), host="127.0.0.1", port=port, http="httptools", lifespan="off",
            log_level="warning", access_log=False)
"""
# The same server stack answering a constant: uvicorn (or hypercorn) in one process, a plain ASGI app
# that reads the body and answers a body the size of the service's answer to one item.
CONSTANT = """\
import sys

ANSWER = {answer!r}


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({{"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]}})
    await send({{"type": "http.response.body", "body": ANSWER}})


server, http, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if server == "uvicorn":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=port, http=http, lifespan="off", log_level="warning", access_log=False)
else:
    import asyncio

    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"127.0.0.1:{{port}}"]
    config.accesslog = None
    config.backlog = 1024
    asyncio.run(serve(app, config))
"""


def item(n: int, environment: str = "cheap") -> dict[str, object]:
    return {"environment": environment, "task": {"reference": str(n % 3)}, "trajectory": "1", "id": n}


async def _connection(port: int, request: bytes, count: int, deadline: float) -> int:
    """Send ``request`` ``count`` times on one keep-alive connection, each after the last answer; how many."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    done = 0
    try:
        while done < count and time.perf_counter() < deadline:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"the server answered {head[:40]!r}")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            done += 1
    finally:
        writer.close()
    return done


async def _load(port: int, body: bytes, requests: int) -> float:
    """Requests per second from ``CONNECTIONS`` connections, ``requests`` in all."""
    request = (
        b"POST /v1/score HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    start = time.perf_counter()
    counts = await asyncio.gather(
        *(_connection(port, request, requests // CONNECTIONS, start + TIME_LIMIT) for _ in range(CONNECTIONS))
    )
    return sum(counts) / (time.perf_counter() - start)


def gathered(port: int) -> float:
    """Requests per engine batch the service at ``port`` has gathered so far (its ``/metrics``)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    counts = {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples}
    return counts["engine_gathered_requests_total"] / max(1.0, counts["engine_gathered_batches_total"])


def load(port: int, body: bytes, requests: int) -> float:
    asyncio.run(_load(port, body, CONNECTIONS * 4))  # warm: connections, the plugin's import
    return asyncio.run(_load(port, body, requests))


def single_items(config: Path, requests: int, repeat: int) -> list[list[str]]:
    body = orjson.dumps({"items": [item(1)]})
    bodies = {"async": orjson.dumps({"items": [item(1, "cheap_async")]})}
    ports = {name: free_port() for name in ("serve", "async", "stub", "httptools", "h11", "hypercorn")}
    serve = [sys.executable, "-m", "engine", "serve", "--config", str(config), "--port", str(ports["serve"])]
    with tempfile.TemporaryDirectory() as tmp, running(serve, ports["serve"], timeout=60):
        # the constant is what the service answers one item with, byte for byte
        constant_answer = httpx.post(f"http://127.0.0.1:{ports['serve']}/v1/score", content=body).content
        script = Path(tmp, "constant.py")
        script.write_text(textwrap.dedent(CONSTANT.format(answer=constant_answer)))
        stub = Path(tmp, "stub.py")
        stub.write_text(STUB)
        stacks = {
            # the same service again, scoring the plugin's async twin (on the loop, no thread hop)
            "async": [sys.executable, "-m", "engine", "serve", "--config", str(config), "--port", str(ports["async"])],
            "stub": [sys.executable, str(stub), str(ports["stub"])],
            "httptools": [sys.executable, str(script), "uvicorn", "httptools", str(ports["httptools"])],
            "h11": [sys.executable, str(script), "uvicorn", "h11", str(ports["h11"])],
            "hypercorn": [sys.executable, str(script), "hypercorn", "-", str(ports["hypercorn"])],
        }
        with contextlib.ExitStack() as stack:
            for name, command in stacks.items():
                stack.enter_context(running(command, ports[name], timeout=60))
            rates: dict[str, list[float]] = {name: [] for name in ports}
            for _ in range(repeat):  # alternating, so that each run's figures share their moment
                for name, port in ports.items():
                    rates[name].append(load(port, bodies.get(name, body), requests))
            shared = {name: gathered(ports[name]) for name in ("serve", "async")}

    def ratio(name: str) -> str:
        return f"{statistics.median(r / c for r, c in zip(rates[name], rates['httptools'], strict=True)):.2f}x"

    median = {name: statistics.median(values) for name, values in rates.items()}
    constant = ["uvicorn+httptools, constant", f"{median['httptools']:,.0f}"]
    return [
        ["engine serve, cheap plugin", f"{median['serve']:,.0f}", *constant, ratio("serve"), ">= 0.5x"],
        ["  engine serve, its async twin", f"{median['async']:,.0f}", *constant, ratio("async"), "(for the record)"],
        ["  requests per engine batch: plugin / async twin", f"{shared['serve']:.1f} / {shared['async']:.1f}", "", "",
         "", "(gathered)"],
        ["  the service over a stub engine", f"{median['stub']:,.0f}", *constant, ratio("stub"), "(for the record)"],
        ["  (stack) uvicorn+h11, constant", f"{median['h11']:,.0f}", "uvicorn+httptools, constant",
         f"{median['httptools']:,.0f}", f"{median['h11'] / median['httptools']:.2f}x", "(the choice)"],
        ["  (stack) hypercorn, constant", f"{median['hypercorn']:,.0f}", "uvicorn+httptools, constant",
         f"{median['httptools']:,.0f}", f"{median['hypercorn'] / median['httptools']:.2f}x", "(the choice)"],
    ]


async def _batch(config: Path, url: str, repeat: int) -> list[str]:
    items = [item(n) for n in range(BATCH)]
    remote_times, local_times = [], []
    async with engine.Engine.from_config(config) as local, engine.Engine.connect(url) as remote:
        assert await local.score(items) == await remote.score(items)  # warm, and the same rewards
        for _ in range(repeat):
            start = time.perf_counter()
            await remote.score(items)
            remote_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            await local.score(items)
            local_times.append(time.perf_counter() - start)
    ratios = [local_time / remote_time for local_time, remote_time in zip(local_times, remote_times, strict=True)]
    there, here = BATCH / statistics.median(remote_times), BATCH / statistics.median(local_times)
    return [f"{BATCH:,}-item batch through connect()", f"{there:,.0f}", "the same in-process", f"{here:,.0f}",
            f"{statistics.median(ratios):.2f}x", ">= 0.5x"]


def one_batch(config: Path, repeat: int) -> list[str]:
    port = free_port()
    serve = [sys.executable, "-m", "engine", "serve", "--config", str(config), "--port", str(port)]
    with running(serve, port, timeout=60):
        return anyio.run(_batch, config, f"http://127.0.0.1:{port}", repeat)


def main(requests: int, repeat: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        write_env(Path(tmp, "envs"), "cheap", "plugin", "verify:score", {"verify.py": CHEAP})
        write_env(Path(tmp, "envs"), "cheap_async", "plugin", "verify:score", {"verify.py": CHEAP_ASYNC})
        config = Path(tmp, "engine.toml")
        config.write_text('environments = "envs"\nallow_unpinned = true\n')
        rows = single_items(config, requests, repeat)
        rows.append(one_batch(config, repeat))
    print(f"{machine()}; median of {repeat}\n")
    print(table(
        f"engine serve: {CONNECTIONS} connections of single-item requests; one large batch",
        ["workload", "items/s", "baseline", "baseline items/s", "ratio", "target"],
        rows,
    ))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000, help="requests per load run")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    main(args.requests, args.repeat)
