"""Shared parts of the benchmarks: a fast local reward server, timing, medians, and the table.

Every benchmark runs the engine and its baselines side by side in one process, alternating,
several times, and reports medians: this machine has 2 cores and is noisy, so only the ratios
mean much. Load goes to 127.0.0.1 only, and every loop is bounded.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

REWARD_BODY = '{"reward": 1.0}'


def cpu_seconds() -> float:
    """CPU time of this process (all its threads), user plus system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Sample:
    seconds: float
    cpu: float
    count: int

    @property
    def rate(self) -> float:
        return self.count / self.seconds

    @property
    def cpu_per_item_us(self) -> float:
        return self.cpu / self.count * 1e6


def measure(fn: Callable[[], Any], count: int) -> Sample:
    cpu, start = cpu_seconds(), time.perf_counter()
    fn()
    return Sample(time.perf_counter() - start, cpu_seconds() - cpu, count)


def median_sample(samples: Sequence[Sample]) -> Sample:
    return Sample(
        statistics.median(s.seconds for s in samples),
        statistics.median(s.cpu for s in samples),
        samples[0].count,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout:g} s")


@contextlib.contextmanager
def running(command: list[str], port: int, *, timeout: float = 10.0) -> Iterator[None]:
    """``command`` in a process of its own while the block runs, once it listens on ``port`` (within ``timeout``
    seconds); stopped by SIGTERM after, killed if it has not ended 30 s later."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, timeout)
        yield
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {dir};
  keepalive_requests 10000000;
  keepalive_timeout 300s;
  server {{
    listen 127.0.0.1:{port} backlog=8192;
    location / {{ default_type application/json; return 200 '{body}'; }}
  }}
}}
"""

PYTHON_SERVER = """\
import asyncio, sys
BODY = {body!r}.encode()
HEAD = b"HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\ncontent-length: %d\\r\\n\\r\\n"
RESPONSE = HEAD % len(BODY) + BODY
class P(asyncio.Protocol):
    def connection_made(self, t): self.t, self.buf = t, b""
    def data_received(self, d):
        self.buf += d
        while True:
            head, sep, rest = self.buf.partition(b"\\r\\n\\r\\n")
            if not sep: return
            n = 0
            for line in head.split(b"\\r\\n"):
                if line[:15].lower() == b"content-length:": n = int(line[15:])
            if len(rest) < n: return
            self.buf = rest[n:]
            self.t.write(RESPONSE)
async def main():
    server = await asyncio.get_running_loop().create_server(P, "127.0.0.1", int(sys.argv[1]), backlog=8192)
    await server.serve_forever()
asyncio.run(main())
"""


@contextlib.contextmanager
def reward_server(body: str = REWARD_BODY) -> Iterator[tuple[str, str]]:
    """A fast server answering every POST with ``body``: nginx when installed, else a Python one.

    Yields ``(url, name)``. It runs in its own process, so it does not share this one's CPU time.
    """
    port = free_port()
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    with tempfile.TemporaryDirectory() as tmp:
        if nginx:
            conf = Path(tmp, "nginx.conf")
            conf.write_text(NGINX_CONF.format(dir=tmp, port=port, body=body))
            command, name = [nginx, "-c", str(conf), "-p", tmp], "nginx (1 worker)"
        else:
            script = Path(tmp, "server.py")
            script.write_text(textwrap.dedent(PYTHON_SERVER.format(body=body)))
            command, name = [sys.executable, str(script), str(port)], "python asyncio server"
        with running(command, port):
            yield f"http://127.0.0.1:{port}/score", name


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(cells[0], widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
              for row in cells[1:]]
    return "\n".join(lines)


def machine() -> str:
    return f"{os.cpu_count()} cores, Python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d')}"


def write_env(root: Path, name: str, kind: str, ref: str, files: dict[str, str] | None = None) -> None:
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    manifest = {"kind": "environment", "verifier": {"kind": kind, "ref": ref}}
    (directory / "manifest.json").write_bytes(orjson.dumps(manifest))
    for filename, text in (files or {}).items():
        (directory / filename).write_text(textwrap.dedent(text))
