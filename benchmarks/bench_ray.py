"""Issue 16: ``engine score --ray`` (2 actors) beside single-machine ``engine score``; Ray's start-up, per-block cost.

Rows (Parquet in, row groups of 1,024 rows so that blocks can be small; Parquet out):

* 1,000,000 rows of a cheap plugin (an exact-match check), blocks of 8,192 rows (the default);
* 20,000 rows of a CPU-bound plugin (~1 ms of pure Python a call, calibrated here), blocks of
  1,024 rows (20 blocks for 2 actors). Single-machine runs it with the thread executor (one GIL):
  the target is >= 1.6x that with ``--ray`` on 2 cores.

Each single-machine run is ``python -m engine score`` in a child process (start-up included).
Each Ray run is a child driver calling ``engine.ray.backfill`` (what ``--ray`` calls) against a Ray
started once by this script (4 logical CPUs, the dashboard off), so a run's wall time
includes joining the cluster, starting 2 actors and opening their engines, but not starting Ray;
that is measured apart (a child's ``ray.init()`` of a new local Ray, to its first task's answer).
Per-block overhead: the same 200,000 cheap rows in blocks of 1,024 and of 32,768; the difference in
scoring time over the difference in block count. Fixed job overhead: a 1-row input (one block).

Then Ray 2.60's own resume, ``ray.data.checkpoint.CheckpointConfig`` (beta), on the cheap rows:
``read_parquet`` -> ``engine.ray.score_dataset`` -> ``write_parquet`` keyed on an int64 row column,
its wall time and its checkpoint's bytes per row, beside ``backfill``'s committed parts.

Medians over ``--repeat`` runs; the machine is shared and noisy (2 cores): only ratios mean much.

    .venv/bin/python benchmarks/bench_ray.py [--rows-cheap N] [--rows-cpu N] [--repeat R] [--no-checkpoint]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from _common import machine, table, write_env

ROOT = Path(__file__).resolve().parent.parent
# the local Rays the children start listen on 127.0.0.1 only (Ray takes 127.0.0.1 for the machine's interface
# otherwise); the children inherit it
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
CHILD_LIMIT = 1200.0  # seconds any one child may run
ROW_GROUP = 1024
WRITE_BLOCK = 65_536

EXACT = """\
def score(task, trajectory):
    return 1.0 if str(trajectory).strip().lower() == str(task["reference"]).strip().lower() else 0.0
"""

CPU = """\
LOOPS = {loops}


def score(task, trajectory):
    total = 0
    for i in range(LOOPS):  # ~1 ms of pure Python: it holds the GIL throughout
        total += i * i % 7
    return (total + task["n"]) % 100 / 100
"""

BACKFILL = """\
import sys, time
import orjson
import engine, engine.ray
source, out, config, actors, block_rows, address = sys.argv[1:7]
began = time.perf_counter()
summary = engine.ray.backfill(source, out, engine.load_config(config), actors=int(actors),
                              block_rows=int(block_rows), address=address)
sys.stdout.write(orjson.dumps({"wall": time.perf_counter() - began, "rows": summary.rows, **summary.seconds}).decode())
"""

RAY_START = """\
import sys, time
began = time.perf_counter()
import ray
imported = time.perf_counter()
ray.init(include_dashboard=False, num_cpus=2, logging_level="ERROR")
ray.get(ray.remote(lambda: 1).remote())
done = time.perf_counter()
ray.shutdown()
sys.stdout.write(f"{imported - began} {done - imported}")
"""

CHECKPOINTED = """\
import os, sys, time
import orjson
import ray, ray.data
from ray.data.checkpoint import CheckpointConfig
import engine, engine.ray
source, out, checkpoint, config, actors, block_rows, address = sys.argv[1:8]
began = time.perf_counter()
ray.init(address=address, logging_level="ERROR")
ctx = ray.data.DataContext.get_current()
ctx.checkpoint_config = CheckpointConfig(id_column="row", checkpoint_path=checkpoint,
                                         delete_checkpoint_on_success=False)
dataset = ray.data.read_parquet(source)
scored = engine.ray.score_dataset(dataset, engine.load_config(config), actors=int(actors), batch_size=int(block_rows))
scored.select_columns(["row", "id", "reward", "verifier"]).write_parquet(out)
wall = time.perf_counter() - began
size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(checkpoint) for f in fs)
sys.stdout.write(orjson.dumps({"wall": wall, "checkpoint_bytes": size}).decode())
"""


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S", "300")
    return env


def run(command: list[str], cwd: Path) -> str:
    done = subprocess.run(command, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=CHILD_LIMIT)
    if done.returncode != 0:
        raise SystemExit(f"{command[:4]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def calibrate(target: float = 1e-3) -> int:
    """Loop count of the CPU plugin's loop that takes ``target`` seconds here (median of a few tries)."""
    loops = 10_000
    times = []
    for _ in range(5):
        began = time.perf_counter()
        total = 0
        for i in range(loops):
            total += i * i % 7
        times.append(time.perf_counter() - began)
    return max(1, round(loops * target / statistics.median(times)))


def write_rows(path: Path, count: int, environment: str, *, row_column: bool = False) -> None:
    schema = pa.schema([("id", pa.int64()), ("environment", pa.string()), ("task", pa.string()),
                        ("trajectory", pa.string()), *([("row", pa.int64())] if row_column else [])])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, count, WRITE_BLOCK):
            ids = list(range(start, min(start + WRITE_BLOCK, count)))
            columns: dict[str, list[Any]] = {
                "id": ids,
                "environment": [environment] * len(ids),
                "task": [orjson.dumps({"n": i, "reference": str(i + 1)}).decode() for i in ids],
                "trajectory": [str(i + 1) if i % 3 else "wrong" for i in ids],
            }
            if row_column:
                columns["row"] = ids
            writer.write_table(pa.table(columns, schema=schema), row_group_size=ROW_GROUP)


def single(source: Path, work: Path) -> float:
    out = work / "single.parquet"
    out.unlink(missing_ok=True)
    began = time.perf_counter()
    run([sys.executable, "-m", "engine", "score", str(source), "-o", str(out), "--config", "engine.toml"], work)
    return time.perf_counter() - began


def on_ray(source: Path, work: Path, address: str, block_rows: int, actors: int = 2) -> dict[str, float]:
    out = work / "ray-out"
    shutil.rmtree(out, ignore_errors=True)
    found: dict[str, float] = orjson.loads(run([sys.executable, "-c", BACKFILL, str(source), str(out), "engine.toml",
                                                str(actors), str(block_rows), address], work))
    parts = list(out.glob("part-*.parquet"))
    rows = sum(pq.ParquetFile(p).metadata.num_rows for p in parts)
    assert rows == found["rows"] and (out / "_SUCCESS").exists(), (rows, found)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows-cheap", type=int, default=1_000_000)
    parser.add_argument("--rows-cpu", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-checkpoint", action="store_true", help="skip Ray Data's CheckpointConfig")
    parser.add_argument("--only-cpu", action="store_true", help="the CPU-bound rows alone (no cheap rows, overheads)")
    args = parser.parse_args()
    print(f"bench_ray: {machine()}")
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        work = Path(tmp)
        loops = calibrate()
        write_env(work / "envs", "exact", "plugin", "verify:score", {"verify.py": EXACT})
        write_env(work / "envs", "cpu", "plugin", "verify:score", {"verify.py": CPU.format(loops=loops)})
        (work / "engine.toml").write_text('environments = "envs"\nallow_unpinned = true\n')
        cheap, cpu = work / "cheap.parquet", work / "cpu.parquet"
        write_rows(cheap, 0 if args.only_cpu else args.rows_cheap, "exact")
        write_rows(cpu, args.rows_cpu, "cpu")
        small = work / "small.parquet"
        write_rows(small, 200_000, "exact")
        one = work / "one.parquet"
        write_rows(one, 1, "exact")

        starts = [tuple(map(float, run([sys.executable, "-c", RAY_START], work).split())) for _ in range(args.repeat)]
        import ray  # this process runs the Ray the drivers join, and stops it: no other Ray on the machine is touched

        ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        address = ray.get_runtime_context().gcs_address
        try:
            results = []
            runs = [("cheap plugin", cheap, args.rows_cheap, 8192),
                    ("CPU-bound plugin, ~1 ms", cpu, args.rows_cpu, 1024)]
            for name, source, rows, block_rows in runs[1:] if args.only_cpu else runs:
                singles, rays, scoring = [], [], []
                for _ in range(args.repeat):
                    singles.append(single(source, work))
                    found = on_ray(source, work, address, block_rows)
                    rays.append(found["wall"])
                    scoring.append(found["scoring"])
                s, r, sc = statistics.median(singles), statistics.median(rays), statistics.median(scoring)
                results.append((name, f"{rows:,}", f"{rows / s:,.0f}", f"{rows / r:,.0f}", f"{rows / sc:,.0f}",
                                f"{s / r:.2f}x"))
            print(table("rows/s, median of runs: single-machine `engine score` vs --ray with 2 actors (wall: joining "
                        "Ray, starting actors included; scoring: from the map's start to its last block)",
                        ["rows", "count", "single", "--ray wall", "--ray scoring", "wall ratio"], results))
            if args.only_cpu:
                return

            fine = [on_ray(small, work, address, 1024) for _ in range(args.repeat)]
            coarse = [on_ray(small, work, address, 32768) for _ in range(args.repeat)]
            tiny = [on_ray(one, work, address, 1024) for _ in range(args.repeat)]
            blocks_fine, blocks_coarse = -(-200_000 // 1024), -(-200_000 // 32768)
            fine_s = statistics.median(f["scoring"] for f in fine)
            coarse_s = statistics.median(f["scoring"] for f in coarse)
            per_block = (fine_s - coarse_s) / (blocks_fine - blocks_coarse)
            rows_overhead = [
                ("ray.init() of a new local Ray (import / start to first task)",
                 f"{statistics.median(s[0] for s in starts):.2f} s / {statistics.median(s[1] for s in starts):.2f} s"),
                ("driver joining a running Ray", f"{statistics.median(f['ray_start'] for f in tiny):.2f} s"),
                ("1-row job: 2 actors started, engines opened, 1 block",
                 f"{statistics.median(f['scoring'] for f in tiny):.2f} s"),
                ("200k cheap rows: scoring in 1,024-row / 32,768-row blocks", f"{fine_s:.2f} s / {coarse_s:.2f} s"),
                ("per-block overhead (difference / extra blocks, 2 actors)", f"{per_block * 1e3:.1f} ms"),
            ]
            print(table("Ray overheads (medians)", ["what", "time"], rows_overhead))

            if not args.no_checkpoint:
                keyed = work / "keyed.parquet"
                write_rows(keyed, args.rows_cheap, "exact", row_column=True)
                checkpointed = []
                for _ in range(args.repeat):
                    out, checkpoint = work / "ck-out", work / "ck"
                    shutil.rmtree(out, ignore_errors=True)
                    shutil.rmtree(checkpoint, ignore_errors=True)
                    checkpointed.append(orjson.loads(run([sys.executable, "-c", CHECKPOINTED, str(keyed), str(out),
                                                          str(checkpoint), "engine.toml", "2", "8192", address], work)))
                wall = statistics.median(c["wall"] for c in checkpointed)
                size = statistics.median(c["checkpoint_bytes"] for c in checkpointed)
                print(table("resume: Ray Data's CheckpointConfig (int64 row key) vs backfill's committed parts, cheap "
                            "rows", ["how", "rows/s (wall)", "resume state"],
                            [("CheckpointConfig + write_parquet", f"{args.rows_cheap / wall:,.0f}",
                              f"{size / args.rows_cheap:.1f} bytes/row"),
                             ("backfill (parts named by row range)", results[0][3],
                              "file names only (0 bytes/row)")]))
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
