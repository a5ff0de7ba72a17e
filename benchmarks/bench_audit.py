"""Issue 27: ``engine audit`` of 1% of a stored output, beside scoring that 1% alone plus reading the input's ids.

An audit must cost the time of scoring its sample plus reading the input by id once, streaming: its memory flat in
the output's size. For 100,000 and 1,000,000 rows of a cheap exact-match plugin (pinned), the script writes the input
and the output ``engine score`` would write for it (the same records, provenance included; generating them is not
what is measured), then runs, each in a child of bench_backfill's launcher (its own wall time and peak RSS), medians
over ``--repeat`` runs, alternating:

* ``audit 1%``: ``engine audit OUT --input IN --fraction 0.01`` (exit 0: it agrees);
* ``audit 1,000``: ``engine audit OUT --input IN --sample 1000``: a fixed sample, whose peak RSS must not grow with
  the output;
* the baseline the issue names, two children: ``engine score`` of the very rows the 1% audit draws, written to a file
  of their own, and a pass reading every input row's id (each line parsed, its id taken: what finding rows by id
  costs at least).

    .venv/bin/python benchmarks/bench_audit.py [--rows-small N] [--rows-large N] [--repeat R]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

import orjson
from _common import machine, table, write_env
from bench_backfill import EXACT, WRITE_BLOCK, Launcher, Run, rows, write_jsonl

import engine

FRACTION = 0.01
FIXED = 1_000  # the fixed sample's size
SEED = 0

READ_IDS = """\
import sys

import orjson

ids = 0
with open(sys.argv[1], "rb") as f:
    for line in f:
        ids += orjson.loads(line)["id"] is not None
print(ids)
"""


def write_output(path: Path, count: int, digest: str) -> None:
    """The records ``engine score`` writes for ``rows(0, count)`` with the exact plugin (every third is wrong)."""
    verifier = {"kind": "plugin", "ref": "verify:score", "environment": "exact", "digest": digest}
    with path.open("wb") as f:
        for start in range(0, count, WRITE_BLOCK):
            stop = min(start + WRITE_BLOCK, count)
            f.write(b"".join(orjson.dumps({"id": i, "reward": 1.0 if i % 3 else 0.0, "verifier": verifier}) + b"\n"
                             for i in range(start, stop)))


def write_sample(path: Path, count: int) -> int:
    """The rows an audit of ``count`` rows draws (its seed, its fraction), as an input of their own."""
    size = max(1, round(count * FRACTION))
    chosen = sorted(random.Random(SEED).sample(range(count), size))
    with path.open("wb") as f:
        f.write(b"".join(orjson.dumps(row) + b"\n" for i in chosen for row in rows(i, i + 1)))
    return size


def median(runs: list[Run]) -> Run:
    return Run(statistics.median(r.seconds for r in runs), statistics.median(r.peak_rss_mb for r in runs))


def main(small: int, large: int, repeat: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        launcher = Launcher(root / "launcher.py")
        envs = root / "envs"
        write_env(envs, "exact", "plugin", "verify:score", {"verify.py": EXACT})
        digest = engine.digest_directory(envs / "exact")
        config = root / "engine.toml"
        config.write_text(f'environments = "envs"\n\n[pins]\nexact = "{digest}"\n')
        read_ids = root / "read_ids.py"
        read_ids.write_text(READ_IDS)
        lines = []
        for count in (small, large):
            source, output, sample = root / f"in-{count}.jsonl", root / f"out-{count}.jsonl", root / f"s-{count}.jsonl"
            write_jsonl(source, count)
            write_output(output, count, digest)
            drawn = write_sample(sample, count)
            audit = [sys.executable, "-m", "engine", "audit", str(output), "--input", str(source), "--seed", str(SEED),
                     "--config", str(config)]
            runs: dict[str, list[Run]] = {"audit": [], "fixed": [], "score": [], "ids": []}
            for attempt in range(repeat):  # alternating, so that the machine's load falls on all alike
                runs["audit"].append(launcher.run([*audit, "--fraction", str(FRACTION)], root / "audit.log"))
                runs["fixed"].append(launcher.run([*audit, "--sample", str(FIXED)], root / "audit.log"))
                runs["score"].append(launcher.run(
                    [sys.executable, "-m", "engine", "score", str(sample), "-o", str(root / f"o-{attempt}.jsonl"),
                     "--config", str(config)], root / "score.log"))
                runs["ids"].append(launcher.run([sys.executable, str(read_ids), str(source)], root / "ids.log"))
            got = {name: median(values) for name, values in runs.items()}
            baseline = got["score"].seconds + got["ids"].seconds
            lines.append([f"{count:,}", f"{drawn:,}", f"{got['audit'].seconds:.2f}", f"{got['score'].seconds:.2f}",
                          f"{got['ids'].seconds:.2f}", f"{got['audit'].seconds / baseline:.2f}x",
                          f"{got['audit'].peak_rss_mb:.0f}", f"{got['fixed'].peak_rss_mb:.0f}",
                          f"{got['score'].peak_rss_mb:.0f}"])
        launcher.close()
    print(table(f"engine audit --fraction {FRACTION} vs engine score of its sample alone + reading the input's ids "
                f"({machine()}, medians of {repeat})",
                ["rows", "sampled", "audit 1% s", "score 1% s", "read ids s", "audit / (score + ids)",
                 "audit 1% peak MiB", f"audit {FIXED:,} peak MiB", "score 1% peak MiB"], lines))
    fixed = [float(line[7]) for line in lines]
    print(f"audit --sample {FIXED:,} peak RSS, {large:,} vs {small:,} rows: {fixed[1] / fixed[0]:.2f}x (flat: ~1.0x)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows-small", type=int, default=100_000)
    parser.add_argument("--rows-large", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    main(args.rows_small, args.rows_large, args.repeat)
