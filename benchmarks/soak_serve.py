"""``engine serve`` soaked: 10^5 requests, one in ten hostile, with the service's RSS and open files sampled.

Most requests score one item (or 16) of a cheap plugin on keep-alive connections; the others are what
issue 22 found: heads half sent and left open, bodies cut off, bodies that are not JSON or hold NaN,
a wrong token, a batch over ``--max-items``, a ``first_index`` past int64, a plugin raising
``KeyboardInterrupt``, a task holding a 65-bit integer, a client that hangs up mid-batch. Every
answer is checked against what it must be (a wrong one stops the run). The service's resident memory
and open descriptors are read from ``/proc`` every tenth of the run, and once more after its head
timeout has closed what the hostile clients left open: flat means the last sample is within 10% (RSS)
and a handful (files) of the first taken after warm-up.

    .venv/bin/python benchmarks/soak_serve.py [--requests N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
from _common import free_port, machine, table, wait_for_port, write_env

CONNECTIONS = 32
TIME_LIMIT = 600.0  # seconds the whole soak may take, whatever its count
HEAD_TIMEOUT = 1.0
TOKEN = "soak-token"
CHEAP = """\
def score(task, trajectory):
    if trajectory == "interrupt":
        raise KeyboardInterrupt("the plugin's own")
    wide = task.get("wide")
    if wide is not None:
        return 1.0 if wide == 2**64 + 1 else 0.0
    return 1.0 if trajectory == task["reference"] else 0.0
"""
HOSTILE = ("half_head", "cut_body", "not_json", "nan", "no_token", "too_many", "first_index", "interrupt", "wide",
           "hang_up")


def item(n: int) -> dict[str, object]:
    return {"environment": "cheap", "task": {"reference": str(n % 7)}, "trajectory": str(n % 5)}


def sample(pid: int) -> tuple[int, int]:
    """The service's resident memory (bytes) and open descriptors now."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024, len(os.listdir(f"/proc/{pid}/fd"))


async def raw(port: int, data: bytes, *, read: bool = True, hold: list[asyncio.StreamWriter] | None = None) -> bytes:
    """``data`` sent on a connection of its own; the answer read to its end (or the writer kept open in ``hold``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    if hold is not None:
        hold.append(writer)
        return b""
    answer = await asyncio.wait_for(reader.read(), 30) if read else b""
    writer.close()
    return answer


def head(body: bytes, token: str = TOKEN, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    return (f"POST /v1/score HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {token}\r\n"
            f"content-type: application/json\r\ncontent-length: {size}\r\nconnection: close\r\n\r\n").encode() + body


async def hostile(kind: str, port: int, client: httpx.AsyncClient, url: str, held: list[asyncio.StreamWriter]) -> None:
    """One hostile request of ``kind``; AssertionError if the service answered it other than it must."""
    if kind == "half_head":
        await raw(port, b"POST /v1/score HTTP/1.1\r\nhost: 127.0.0.1\r\n", hold=held)
    elif kind == "cut_body":
        await raw(port, head(b'{"items": [', length=1000), read=False)
    elif kind == "hang_up":
        await raw(port, head(orjson.dumps({"items": [item(n) for n in range(64)]})), read=False)
    elif kind == "no_token":
        assert (await raw(port, head(b'{"items": []}', token="wrong"))).startswith(b"HTTP/1.1 401")
    else:
        body, status = {
            "not_json": (b'{"items": [', 400),
            "nan": (b'{"items": [{"environment": "cheap", "task": {"reference": NaN}, "trajectory": ""}]}', 400),
            "too_many": (orjson.dumps({"items": [item(n) for n in range(300)]}), 413),
            "first_index": (orjson.dumps({"items": [item(0), item(1)], "first_index": 2**64 - 1}), 400),
            "interrupt": (orjson.dumps({"items": [{**item(0), "trajectory": "interrupt"}]}), 422),
            "wide": (b'{"items": [{"environment": "cheap", "task": {"wide": 18446744073709551617}, "trajectory": ""}]}',
                     200),
        }[kind]
        response = await client.post(url, content=body)
        assert response.status_code == status, (kind, response.status_code, response.text)
        if kind == "wide":
            assert response.json()["rewards"] == [1.0]


async def load(port: int, total: int, pid: int) -> list[tuple[int, int, int]]:
    url = f"http://127.0.0.1:{port}/v1/score"
    headers = {"authorization": f"Bearer {TOKEN}"}
    limits = httpx.Limits(max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS)
    held: list[asyncio.StreamWriter] = []
    samples: list[tuple[int, int, int]] = []
    sent = 0
    rng = random.Random(22)
    deadline = time.monotonic() + TIME_LIMIT
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=60) as client:

        async def worker() -> None:
            nonlocal sent
            while sent < total and time.monotonic() < deadline:
                n = sent
                sent += 1
                if n % (total // 10) == 0:
                    samples.append((n, *sample(pid)))
                if n % 10 == 9:
                    await hostile(HOSTILE[(n // 10) % len(HOSTILE)], port, client, url, held)
                    continue
                items = [item(n + k) for k in range(16 if rng.random() < 0.1 else 1)]
                response = await client.post(url, content=orjson.dumps({"items": items}))
                assert response.status_code == 200, response.text
                rewards = response.json()["rewards"]
                assert rewards == [1.0 if it["trajectory"] == it["task"]["reference"] else 0.0 for it in items]

        await asyncio.gather(*(worker() for _ in range(CONNECTIONS)))
    await asyncio.sleep(3 * HEAD_TIMEOUT)  # what the hostile clients left open is closed by now
    samples.append((sent, *sample(pid)))
    for writer in held:
        writer.close()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_env(root / "envs", "cheap", "plugin", "verify:score", {"verify.py": CHEAP})
        (root / "engine.toml").write_text('environments = "envs"\nallow_unpinned = true\n')
        port = free_port()
        command = [sys.executable, "-m", "engine", "serve", "--config", str(root / "engine.toml"), "--port", str(port),
                   "--token-env", "SOAK_TOKEN", "--max-items", "256", "--head-timeout", str(HEAD_TIMEOUT),
                   "--body-timeout", str(HEAD_TIMEOUT)]
        service = subprocess.Popen(command, env={**os.environ, "SOAK_TOKEN": TOKEN}, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        try:
            wait_for_port(port, 60)
            started = time.perf_counter()
            samples = asyncio.run(load(port, args.requests, service.pid))
            took = time.perf_counter() - started
        finally:
            service.send_signal(signal.SIGTERM)
            _, err = service.communicate(timeout=60)
    rows = [(f"{n:,}", f"{rss / 2**20:.1f}", files) for n, rss, files in samples]
    print(f"# soak_serve: {args.requests:,} requests (1 in 10 hostile) in {took:.1f} s, {machine()}")
    print(table("the service's RSS and open files", ("requests", "RSS MiB", "open files"), rows))
    _, rss0, files0 = samples[2]  # after warm-up (a fifth of the run)
    _, rss1, files1 = samples[-1]
    flat = rss1 <= rss0 * 1.10 and files1 <= files0 + 5
    print(f"RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB, open files {files0} -> {files1}: "
          f"{'flat' if flat else 'GREW'}; service exit {service.returncode}, tracebacks in its log: "
          f"{err.count('Traceback')}")


if __name__ == "__main__":
    main()
