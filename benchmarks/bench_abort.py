"""Target 4: abort. 10,000 items against a server that holds every request 5 s; one item fails.

``score`` must raise within 50 ms of the failure, and every connection must be closed (the server
counts them). The server is a small asyncio HTTP/1.1 server run as a subprocess: it holds each
request ``--hold`` seconds before answering ``{"reward": 1.0}``, counts open connections and held
requests, and keeps a timeline of both, which a control port (a line protocol, a second port)
serves. Its timestamps are CLOCK_MONOTONIC, the clock of ``time.perf_counter`` here (checked at
start), so the failure, the raise and the last close are compared on one clock across processes.

Two failures, each with 64 and with 1,024 endpoint calls in flight (the endpoint's
``max_concurrency``; 10,000 items in all, so the rest are queued):

* plugin: an ``async def`` plugin item waits (on the control port) until the server holds as many
  requests as the endpoint may have in flight, takes ``time.perf_counter()`` and the event loop
  thread's CPU time, writes them to a file and raises;
* HTTP 400: one endpoint item of the first wave is answered 400 at once when the server holds that
  many requests (the server takes the failure's time just before writing it). The 400 says
  ``connection: close``, so "every connection closed" is reachable while the engine stays open
  (a keep-alive connection back in the idle pool is reuse, not a leak).

For the record, the case the issue measured on stock httpx (28 s): 1,024 calls in flight over a pool
of only 64 connections, so 960 requests wait in the transport's pool when the plugin fails.

"raise" is the failure to ``score`` raising; "CPU" is the event loop thread's CPU time over that
interval (plugin failures only), which other processes on a busy machine do not inflate; "open at
raise" is the server's count of open connections at that instant (it lags the client's closes by
the server's own time to process them); "all closed" is the failure to the server counting 0, with
the engine still open (a trainer keeps its engine across batches).
Medians and max over ``--repeat`` runs.
Then, for the record, the same through httpx's stock transport (httpcore's pool), bounded by
``--stock-timeout``.

    .venv/bin/python benchmarks/bench_abort.py [--items N] [--repeat R] [--hold S] [--stock-timeout S]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
from _common import free_port, machine, table, wait_for_port, write_env

import engine
from engine._http.transport import PoolTransport

LEVELS = (64, 1024)
QUEUED = (1024, 64)  # in flight, connections: requests queue in the transport's pool
RAISE_TARGET = 0.050  # seconds from the failure to score raising
CLOSE_LIMIT = 30.0  # seconds to wait for the server to count 0 open connections, after the raise
POLL = 0.002  # seconds between questions to the control port while waiting for 0

HOLD_SERVER = r'''
"""Holds every POST, counts connections; a control port serves the counts and their timeline."""
import asyncio
import json
import sys
import time

PORT, CONTROL, HOLD = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
now = time.monotonic  # CLOCK_MONOTONIC, the client's perf_counter


def response(status, body, extra=b""):
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        status, len(body), extra, body)


OK = response(b"200 OK", b'{"reward": 1.0}')
BAD = response(b"400 Bad Request", b'{"error": "this item fails on purpose"}', b"connection: close\r\n")


class State:
    def __init__(self):
        self.open = self.pending = self.requests = self.aborted = 0
        self.events = []  # (time, open connections, held requests), after every change
        self.waiters = []  # (held requests to wait for, future)
        self.failing = []  # (held requests to wait for, connection) of requests to answer 400
        self.fail_at = None

    def changed(self):
        self.events.append((now(), self.open, self.pending))
        if self.waiters:
            ready = [w for w in self.waiters if self.pending >= w[0]]
            for w in ready:
                self.waiters.remove(w)
                if not w[1].done():
                    w[1].set_result(None)
        ready = [f for f in self.failing if self.pending >= f[0]]
        for f in ready:
            self.failing.remove(f)
            self.fail_at = now()
            f[1].answer(BAD, close=True)

    def report(self, at):
        before = [e for e in self.events if e[0] <= at]
        open_at, pending_at = (before[-1][1], before[-1][2]) if before else (self.open, self.pending)
        zero_at = None
        if self.open == 0:
            zero_at = self.events[-1][0] if self.events else now()
            for t, count, _ in reversed(self.events):
                if count:
                    break
                zero_at = t
        return {"open": self.open, "pending": self.pending, "open_at": open_at, "pending_at": pending_at,
                "zero_at": zero_at, "fail_at": self.fail_at, "requests": self.requests, "aborted": self.aborted,
                "peak": max((e[1] for e in self.events), default=self.open)}


S = State()


class Connection(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.buffer, self.timer, self.busy = transport, b"", None, False
        S.open += 1
        S.changed()

    def data_received(self, data):
        self.buffer += data
        while True:
            head, sep, rest = self.buffer.partition(b"\r\n\r\n")
            if not sep:
                return
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if len(rest) < length:
                return
            self.buffer = rest[length:]
            self.request(rest[:length])

    def request(self, body):
        S.requests += 1
        S.pending += 1
        self.busy = True
        fail_when = json.loads(body)["task"].get("fail_when")
        if fail_when is None:
            self.timer = asyncio.get_running_loop().call_later(HOLD, self.answer, OK)
        else:
            S.failing.append((fail_when, self))
        S.changed()

    def answer(self, data, close=False):
        self.timer, self.busy = None, False
        S.pending -= 1
        self.transport.write(data)
        if close:
            self.transport.close()
        S.changed()

    def connection_lost(self, exc):
        if self.timer is not None:
            self.timer.cancel()
        if self.busy:  # the client gave up on a held request
            self.busy = False
            S.pending -= 1
            S.aborted += 1
        S.failing = [f for f in S.failing if f[1] is not self]
        S.open -= 1
        S.changed()


async def control(reader, writer):
    while line := await reader.readline():
        command, *args = line.split()
        if command == b"reset":
            S.events.clear()
            S.requests = S.aborted = 0
            S.fail_at = None
            reply = {"open": S.open}
        elif command == b"wait":  # until the server holds this many requests
            if S.pending < int(args[0]):
                future = asyncio.get_running_loop().create_future()
                S.waiters.append((int(args[0]), future))
                await future
            reply = {"pending": S.pending}
        elif command == b"report":  # the counts now, and at a (monotonic) instant
            reply = S.report(float(args[0]))
        else:
            reply = {"error": line.decode()}
        writer.write(json.dumps(reply).encode() + b"\n")
        await writer.drain()
    writer.close()


async def main():
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Connection, "127.0.0.1", PORT, backlog=8192)
    control_server = await asyncio.start_server(control, "127.0.0.1", CONTROL)
    async with server, control_server:
        await asyncio.gather(server.serve_forever(), control_server.serve_forever())


asyncio.run(main())
'''

FAILING_PLUGIN = '''\
"""Fails once the endpoint lane is at its concurrency; the failure's instant goes to a file."""
import asyncio
import os
import time


async def score(task, trajectory):
    reader, writer = await asyncio.open_connection("127.0.0.1", task["control"])
    writer.write(b"wait %d\\n" % task["fail_when"])
    await reader.readline()
    writer.close()
    failed_at, cpu = time.perf_counter(), time.thread_time()  # this runs on the event loop's thread
    with open(os.environ["BENCH_ABORT_FAILED_AT"], "w") as f:
        f.write(f"{failed_at!r} {cpu!r}")
    raise RuntimeError("this verifier fails on purpose")
'''


class Control:
    """The hold server's control port: one line out, one JSON line back."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    @classmethod
    async def connect(cls, port: int) -> Control:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def ask(self, line: str) -> dict[str, Any]:
        self._writer.write(line.encode() + b"\n")
        await self._writer.drain()
        reply: dict[str, Any] = orjson.loads(await self._reader.readline())
        return reply

    async def wait_closed(self, limit: float) -> dict[str, Any]:
        """Poll until the server counts 0 open connections, or ``limit`` seconds pass."""
        deadline = time.perf_counter() + limit
        report = await self.ask(f"report {time.perf_counter()!r}")
        while report["open"] and time.perf_counter() < deadline:
            await asyncio.sleep(POLL)
            report = await self.ask(f"report {time.perf_counter()!r}")
        return report


@dataclass
class Trial:
    raised: float | None  # seconds from the failure to score raising; None: not within the limit
    cpu: float | None  # CPU seconds of the event loop's thread over that interval (plugin failures)
    open_at_raise: int | None
    held_at_raise: int | None
    closed: float | None  # seconds from the failure to 0 open connections; None: not within the limit
    open_left: int  # open connections when the wait for 0 ended
    peak: int  # the most connections open at once
    requests: int  # requests the server received


@dataclass
class Setup:
    envs: Path
    control_port: int
    failed_at_file: Path
    items: int


def batch(setup: Setup, failure: str, level: int, wave: int) -> list[dict[str, Any]]:
    """The items: ``wave`` is how many requests reach the server at once (``level``, or fewer connections)."""
    items: list[dict[str, Any]] = [
        {"environment": "held", "task": {"n": i}, "trajectory": "x"} for i in range(setup.items)
    ]
    if failure == "plugin":  # after the endpoint's first wave, though lanes start together anyway
        items[level] = {"environment": "failing", "task": {"control": setup.control_port, "fail_when": wave},
                        "trajectory": "x"}
    else:  # the last item of the first wave: answered 400 once the server holds the whole wave
        items[wave - 1]["task"]["fail_when"] = wave
    return items


async def trial(
    setup: Setup,
    control: Control,
    failure: str,
    level: int,
    connections: int,
    transport: Callable[[int], httpx.AsyncBaseTransport] | None,
    raise_limit: float,
) -> Trial:
    await control.ask("reset")
    setup.failed_at_file.unlink(missing_ok=True)
    config = engine.EngineConfig(
        environments=setup.envs,
        allow_unpinned=True,
        defaults=engine.Limits(max_concurrency=level),
        max_in_flight=level + 1,  # room for the plugin item beside a full endpoint lane
    )
    items = batch(setup, failure, level, min(level, connections))
    expected_kind = "plugin" if failure == "plugin" else "endpoint"
    raised_at: float | None = None
    raised_cpu = 0.0
    async with engine.Engine(config, transport=transport(connections) if transport else None) as eng:
        with anyio.move_on_after(raise_limit):
            try:
                await eng.score(items)
            except engine.VerificationError as exc:
                raised_at, raised_cpu = time.perf_counter(), time.thread_time()
                if exc.kind != expected_kind:
                    raise RuntimeError(f"the wrong failure aborted the batch: {exc}") from exc
            else:
                raise RuntimeError("the batch did not fail")
        stop = time.perf_counter()
        report = await control.wait_closed(CLOSE_LIMIT)
        failed_cpu = None
        if failure == "plugin":
            if setup.failed_at_file.exists():
                failed_at, failed_cpu = map(float, setup.failed_at_file.read_text().split())
            else:
                failed_at = None
        else:
            failed_at = report["fail_at"]
        if failed_at is None:
            raise RuntimeError("the failure never happened")
        at = await control.ask(f"report {raised_at if raised_at is not None else stop!r}")
    # the engine is closed now (its idle connections too): wait for a clean server before the next run
    left = await control.wait_closed(CLOSE_LIMIT)
    if left["open"]:
        raise RuntimeError(f"{left['open']} connections still open {CLOSE_LIMIT:g} s after the engine closed")
    zero_at = report["zero_at"]
    return Trial(
        raised=raised_at - failed_at if raised_at is not None else None,
        cpu=raised_cpu - failed_cpu if raised_at is not None and failed_cpu is not None else None,
        open_at_raise=at["open_at"] if raised_at is not None else None,
        held_at_raise=at["pending_at"] if raised_at is not None else None,
        closed=zero_at - failed_at if zero_at is not None else None,
        open_left=report["open"],
        peak=at["peak"],
        requests=at["requests"],
    )


def ms(seconds: float | None, limit: float) -> str:
    return f"> {limit:g} s" if seconds is None else f"{seconds * 1e3:,.1f}"


def summary(trials: list[Trial], raise_limit: float) -> tuple[str, str, str, str, str, bool]:
    """Median (max) of: raise, its CPU, open at raise, all closed; then peak open, and whether the target is met."""

    def spread(values: list[float | None], limit: float) -> str:
        if any(v is None for v in values):
            known = [v for v in values if v is not None]
            return f"> {limit:g} s ({len(values) - len(known)} of {len(values)})"
        numbers = [v for v in values if v is not None]
        return f"{ms(statistics.median(numbers), limit)} ({ms(max(numbers), limit)})"

    raised = spread([t.raised for t in trials], raise_limit)
    cpus = [t.cpu for t in trials]
    cpu = "-" if any(c is None for c in cpus) else spread(cpus, raise_limit)
    closed = spread([t.closed for t in trials], CLOSE_LIMIT)
    opens = [t.open_at_raise for t in trials]
    open_at = "-" if any(o is None for o in opens) else (
        f"{statistics.median(o for o in opens if o is not None):g} ({max(o for o in opens if o is not None)})")
    met = all(t.raised is not None and t.raised <= RAISE_TARGET and t.closed is not None for t in trials)
    peak = f"{max(t.peak for t in trials):,}"
    return raised, cpu, open_at, closed, peak, met


def stock_transport(connections: int) -> httpx.AsyncBaseTransport:
    return httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=connections,
                                                        max_keepalive_connections=connections))


async def main(args: argparse.Namespace) -> None:
    if time.get_clock_info("perf_counter").implementation != time.get_clock_info("monotonic").implementation:
        raise SystemExit("perf_counter is not CLOCK_MONOTONIC here: times across processes cannot be compared")
    port, control_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        script = root / "hold_server.py"
        script.write_text(HOLD_SERVER)
        envs = root / "envs"
        url = f"http://127.0.0.1:{port}/score"
        write_env(envs, "held", "endpoint", url)
        write_env(envs, "failing", "plugin", "fail:score", {"fail.py": FAILING_PLUGIN})
        setup = Setup(envs, control_port, root / "failed_at", args.items)
        # The abort is reported by the exception; without a handler the engine logger's ERROR record
        # would reach Python's last-resort handler on every run.
        logging.getLogger("engine").addHandler(logging.NullHandler())
        os.environ["BENCH_ABORT_FAILED_AT"] = str(setup.failed_at_file)
        server = subprocess.Popen([sys.executable, str(script), str(port), str(control_port), str(args.hold)])
        try:
            wait_for_port(port)
            wait_for_port(control_port)
            control = await Control.connect(control_port)
            print(f"hold server: python asyncio, each request held {args.hold:g} s; {machine()}; "
                  f"{args.items:,} items; median (max) of {args.repeat} runs, stock httpx {args.stock_repeat}\n")
            cases = [(failure, level, level + 1) for failure in ("plugin", "HTTP 400") for level in LEVELS]
            cases.append(("plugin", *QUEUED))
            rows = []
            for failure, level, connections in cases:
                workload = f"{failure} fails, {level:,} in flight"
                if connections < level:
                    workload += f" over {connections} connections"
                clients: list[tuple[str, Callable[[int], httpx.AsyncBaseTransport] | None, int, float]] = [
                    ("engine (its pool)", None if connections > level else PoolTransport, args.repeat,
                     args.raise_limit),
                    ("engine over stock httpx", stock_transport, args.stock_repeat, args.stock_timeout),
                ]
                for name, transport, repeat, limit in clients:
                    if not repeat:
                        continue
                    trials = []
                    for _ in range(repeat):
                        trials.append(await trial(setup, control, failure, level, connections, transport, limit))
                    raised, cpu, open_at, closed, peak, met = summary(trials, limit)
                    target = "<= 50 ms, 0 open" if transport is None else "(for the record)"
                    rows.append([workload, name, raised, cpu, open_at, closed, peak, target, "yes" if met else "NO"])
                    print(f"  done: {workload}, {name}", file=sys.stderr)
            print(table(
                "Target 4: abort (times in ms from the failure; median (max))",
                ["workload", "client", "raise", "CPU", "open at raise", "all closed", "peak open", "target", "met"],
                rows,
            ))
        finally:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--stock-repeat", type=int, default=3, help="runs through stock httpx (0: none)")
    parser.add_argument("--hold", type=float, default=5.0, help="seconds the server holds each request")
    parser.add_argument("--raise-limit", type=float, default=30.0, help="seconds to wait for the engine to raise")
    parser.add_argument("--stock-timeout", type=float, default=60.0,
                        help="seconds to wait for stock httpx to raise")
    asyncio.run(main(parser.parse_args()))
