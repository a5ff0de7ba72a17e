"""Target 5: backfill. ``engine score`` over 100,000 and 1,000,000 stored rows with a cheap plugin.

Each run is ``python -m engine score INPUT -o OUTPUT --config engine.toml`` in a child process, as
a user runs it; its wall time (start-up included) gives rows/s, and ``os.wait4`` gives that very
child's peak RSS. Memory must not grow with the file: peak RSS at the large size within 1.1x of
the small one. The plugin is an exact-match check, pinned by digest as in production.

The children are started by a small launcher process, not by this one: Linux counts in a child's
``ru_maxrss`` the resident set of the process it was forked from (the address space ``exec``
replaces), and this one holds pyarrow and the rows it generates. The launcher's ~10 MiB is below
any Python child's own peak, so the maximum is the child's.

Baseline: a bare streaming loop in a child of its own (read a line, ``orjson.loads``, call the
same function, write ``{"id", "reward"}`` with orjson), the least any backfill must do; it has no
checkpoints, no provenance and no resume. Then the same with Parquet in and out (the engine only).
Each output is checked: as many records as rows, and the plugin's rewards. Medians over
``--repeat`` runs.

    .venv/bin/python benchmarks/bench_backfill.py [--rows-small N] [--rows-large N] [--repeat R] [--no-parquet]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from _common import machine, table, write_env

import engine

ROOT = Path(__file__).resolve().parent.parent
RSS_TARGET = 1.1  # peak RSS at the large size / at the small size
CHILD_LIMIT = 600.0  # seconds any one child may run before it is killed
WRITE_BLOCK = 65_536  # rows generated and written at a time

EXACT = """\
def score(task, trajectory):
    return 1.0 if str(trajectory).strip().lower() == str(task["reference"]).strip().lower() else 0.0
"""

BARE = """\
import sys

import orjson

sys.path.insert(0, sys.argv[3])
from verify import score

with open(sys.argv[1], "rb") as rows, open(sys.argv[2], "wb") as out:
    for line in rows:
        row = orjson.loads(line)
        out.write(orjson.dumps({"id": row["id"], "reward": float(score(row["task"], row["trajectory"]))}) + b"\\n")
"""


def rows(start: int, stop: int) -> list[dict[str, object]]:
    return [
        {"id": i, "environment": "exact", "task": {"prompt": f"{i} + 1", "reference": str(i + 1)},
         "trajectory": str(i + 1) if i % 3 else "wrong"}
        for i in range(start, stop)
    ]


def write_jsonl(path: Path, count: int) -> None:
    with path.open("wb") as f:
        for start in range(0, count, WRITE_BLOCK):
            f.write(b"".join(orjson.dumps(row) + b"\n" for row in rows(start, min(start + WRITE_BLOCK, count))))


def write_parquet(path: Path, count: int) -> None:
    schema = pa.schema([
        ("id", pa.int64()),
        ("environment", pa.string()),
        ("task", pa.struct([("prompt", pa.string()), ("reference", pa.string())])),
        ("trajectory", pa.string()),
    ])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, count, WRITE_BLOCK):
            writer.write_table(pa.Table.from_pylist(rows(start, min(start + WRITE_BLOCK, count)), schema=schema))


LAUNCHER = """\
import json, os, subprocess, sys, threading, time

for line in sys.stdin:
    job = json.loads(line)
    with open(job["log"], "wb") as log:
        started = time.perf_counter()
        child = subprocess.Popen(job["command"], stdout=log, stderr=subprocess.STDOUT, cwd=job["cwd"])
        watchdog = threading.Timer(job["limit"], child.kill)
        watchdog.start()
        _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage
        watchdog.cancel()
        seconds = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)  # reaped above: Popen must not wait for it
    reply = {"seconds": seconds, "maxrss_kib": usage.ru_maxrss, "exit": child.returncode}
    print(json.dumps(reply), flush=True)
"""


@dataclass
class Run:
    seconds: float
    peak_rss_mb: float  # the child's own peak resident set (ru_maxrss)


class Launcher:
    """A lean process that runs commands for us and reports each one's wall time and peak RSS."""

    def __init__(self, script: Path) -> None:
        script.write_text(LAUNCHER)
        self._process = subprocess.Popen([sys.executable, "-I", str(script)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE)

    def run(self, command: list[str], log: Path) -> Run:
        """Run ``command`` to completion (killed after ``CHILD_LIMIT`` s); raises if it fails."""
        assert self._process.stdin is not None and self._process.stdout is not None
        job = {"command": command, "log": str(log), "cwd": str(ROOT), "limit": CHILD_LIMIT}
        self._process.stdin.write(orjson.dumps(job) + b"\n")
        self._process.stdin.flush()
        reply = orjson.loads(self._process.stdout.readline())
        if reply["exit"] != 0:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{command[:4]} exited with {reply['exit']}:\n{tail}")
        return Run(reply["seconds"], reply["maxrss_kib"] / 1024)  # ru_maxrss is in KiB on Linux

    def close(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        self._process.wait(10)


def records_in(path: Path) -> int:
    if path.suffix == ".parquet":
        return int(pq.ParquetFile(path).metadata.num_rows)
    with path.open("rb") as f:
        return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))


def check_output(path: Path, count: int, *, engine_output: bool) -> None:
    found = records_in(path)
    if found != count:
        raise RuntimeError(f"{path.name} holds {found:,} records for {count:,} rows")
    if engine_output:  # the rewards are the plugin's: every third trajectory is wrong
        if path.suffix == ".parquet":
            rewards = pq.read_table(path, columns=["reward"]).column("reward").to_pylist()
        else:
            with path.open("rb") as f:
                rewards = [orjson.loads(line)["reward"] for line in f]
        if rewards != [1.0 if i % 3 else 0.0 for i in range(count)]:
            raise RuntimeError(f"{path.name}: the rewards are not the plugin's")
        path.unlink()


def median_run(runs: list[Run]) -> Run:
    return Run(statistics.median(r.seconds for r in runs), statistics.median(r.peak_rss_mb for r in runs))


def main(small: int, large: int, repeat: int, parquet: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        launcher = Launcher(root / "launcher.py")
        envs = root / "envs"
        write_env(envs, "exact", "plugin", "verify:score", {"verify.py": EXACT})
        config = root / "engine.toml"
        config.write_text(f'environments = "envs"\n\n[pins]\nexact = "{engine.digest_directory(envs / "exact")}"\n')
        bare = root / "bare.py"
        bare.write_text(BARE)

        formats = [("jsonl", write_jsonl)] + ([("parquet", write_parquet)] if parquet else [])
        results: dict[tuple[str, str, int], Run] = {}
        startup: dict[str, float] = {}
        for suffix, write in formats:
            one = root / f"one.{suffix}"  # a single row: the command's fixed cost (start-up, imports, finish)
            write(one, 1)
            startup[suffix] = statistics.median(
                launcher.run([sys.executable, "-m", "engine", "score", str(one), "-o", str(root / f"one-out.{suffix}"),
                              "--config", str(config)], root / "engine.log").seconds
                for _ in range(repeat)
            )
            for count in (small, large):
                source = root / f"rows-{count}.{suffix}"
                began = time.perf_counter()
                write(source, count)
                print(f"  wrote {count:,} rows as {suffix} in {time.perf_counter() - began:.1f} s "
                      f"({source.stat().st_size / 2**20:,.0f} MiB)", file=sys.stderr)
                runs: dict[str, list[Run]] = {"engine": [], "bare": []}
                for attempt in range(repeat):
                    output = root / f"out-{count}-{attempt}.{suffix}"
                    command = [sys.executable, "-m", "engine", "score", str(source), "-o", str(output),
                               "--config", str(config)]
                    runs["engine"].append(launcher.run(command, root / "engine.log"))
                    check_output(output, count, engine_output=True)
                    if suffix == "jsonl":
                        output = root / f"bare-{count}-{attempt}.jsonl"
                        runs["bare"].append(launcher.run([sys.executable, str(bare), str(source), str(output),
                                                       str(envs / "exact")], root / "bare.log"))
                        check_output(output, count, engine_output=False)
                        output.unlink()
                for name, measured in runs.items():
                    if measured:
                        results[(suffix, name, count)] = median_run(measured)
                source.unlink()
                print(f"  scored {count:,} {suffix} rows", file=sys.stderr)
        launcher.close()

    print(f"{machine()}; median of {repeat}; wall time includes the interpreter's start-up\n")
    speed_rows = []
    for suffix, _ in formats:
        for count in (small, large):
            ours = results[(suffix, "engine", count)]
            base = results.get((suffix, "bare", count))
            speed_rows.append([
                f"{suffix}, {count:,} rows", f"{ours.seconds:,.1f}", f"{count / ours.seconds:,.0f}",
                f"{count / (ours.seconds - startup[suffix]):,.0f}" if ours.seconds > startup[suffix] else "-",
                "bare loop" if base else "-", f"{count / base.seconds:,.0f}" if base else "-",
                f"{base.seconds / ours.seconds:.2f}x" if base else "-", "(for the record)",
            ])
    print(table(f"Target 5a: backfill speed (engine start-up and finish, 1 row: "
                f"{', '.join(f'{k} {v:.2f} s' for k, v in startup.items())})",
                ["workload", "engine s", "engine rows/s", "without start-up", "baseline", "baseline rows/s",
                 "ratio", "target"], speed_rows))
    memory_rows = []
    for suffix, _ in formats:
        for name in ("engine", "bare"):
            if (suffix, name, small) not in results:
                continue
            low, high = results[(suffix, name, small)], results[(suffix, name, large)]
            ratio = high.peak_rss_mb / low.peak_rss_mb
            target = f"<= {RSS_TARGET}x" if name == "engine" else "(for the record)"
            met = ("yes" if ratio <= RSS_TARGET else "NO") if name == "engine" else ""
            memory_rows.append([f"{suffix}, {large:,} vs {small:,} rows", "engine score" if name == "engine" else
                                "bare loop", f"{low.peak_rss_mb:,.1f}", f"{high.peak_rss_mb:,.1f}", f"{ratio:.2f}x",
                                target, met])
    print()
    print(table("Target 5b: peak RSS of the child (MiB)",
                ["workload", "program", f"at {small:,}", f"at {large:,}", "ratio", "target", "met"], memory_rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows-small", type=int, default=100_000)
    parser.add_argument("--rows-large", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-parquet", dest="parquet", action="store_false", help="JSON Lines only")
    args = parser.parse_args()
    main(args.rows_small, args.rows_large, args.repeat, args.parquet)
