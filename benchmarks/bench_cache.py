"""The verdict cache and in-batch dedup (issue 26, part 1): judge calls and time to rewards of a GRPO-shaped batch.

A batch of 512 prompts x 8 completions, 30% of the completions duplicates within their group, is scored against a
local OpenAI-compatible judge (``tests/servers.py``'s, on 127.0.0.1) that counts calls and scores deterministically:
with ``dedupe = false`` (the baseline), with dedup, with the cache cold and then warm (a second scoring). Each run
is repeated, alternating, and the medians printed; the engine's time per item of an all-hits batch is the warm
run's time over its items. Bounded: ``--repeat`` runs of one batch each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from servers import Request, Response, Server, score

from engine import CacheConfig, Engine, EngineConfig, JudgeConfig

PROMPTS, GROUP = 512, 8


def batch() -> list[dict[str, Any]]:
    """512 groups of 8; per group 3 or 2 completions repeat an earlier one (2.4 of 8 on average: 30%)."""
    items = []
    for g in range(PROMPTS):
        repeats = 3 if g % 5 < 2 else 2
        answers = [str((g + k) % 97) for k in range(GROUP - repeats)]
        answers += answers[:repeats]
        items += [{"environment": "graded", "task": {"prompt": f"question {g}", "reference": "42"},
                   "trajectory": answer} for answer in answers]
    return items


def by_response(request: Request) -> Response:
    text = request.json()["messages"][1]["content"].split("<response>\n", 1)[1].split("\n</response>", 1)[0]
    return score(int(text) % 11)


def workspace(root: Path) -> tuple[Path, Path]:
    envs, rubrics = root / "envs", root / "rubrics"
    (envs / "graded").mkdir(parents=True)
    (envs / "graded" / "manifest.json").write_text(
        '{"kind": "environment", "verifier": {"kind": "rubric", "ref": "acme/grade"}}')
    (rubrics / "acme" / "grade").mkdir(parents=True)
    (rubrics / "acme" / "grade" / "1.md").write_text("+++\nscale = [0, 10]\n+++\nScore the answer.\n")
    return envs, rubrics


async def run(config: EngineConfig, items: list[dict[str, Any]], server: Server) -> tuple[int, float, list[float]]:
    before = len(server.requests)
    async with Engine(config) as eng:
        started = time.perf_counter()
        rewards = await eng.score(items)
        seconds = time.perf_counter() - started
    return len(server.requests) - before, seconds, rewards


async def main(repeat: int) -> None:
    items = batch()
    figures: dict[str, list[tuple[int, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, Server.judge(default=by_response) as server:
        envs, rubrics = workspace(Path(tmp))

        def config(dedupe: bool, cache: Path | None) -> EngineConfig:
            judge = JudgeConfig(base_url=server.base_url, model="bench", dedupe=dedupe, max_concurrency=64)
            return EngineConfig(environments=envs, rubrics=rubrics, judge=judge,
                                cache=CacheConfig(cache) if cache is not None else None)

        for r in range(repeat):
            path = Path(tmp) / f"verdicts-{r}.sqlite"
            runs = [("every item judged (dedupe = false)", config(False, None)), ("dedup", config(True, None)),
                    ("cache, cold", config(True, path)), ("cache, warm (second scoring)", config(True, path))]
            rewards = None
            for name, cfg in runs:
                calls, seconds, got = await run(cfg, items, server)
                assert rewards is None or got == rewards, f"{name}: rewards differ from judging every item"
                rewards = got
                figures.setdefault(name, []).append((calls, seconds))
    base_calls, base_seconds = (statistics.median(x[i] for x in figures["every item judged (dedupe = false)"])
                                for i in (0, 1))
    cold_seconds = statistics.median(x[1] for x in figures["cache, cold"])
    print(f"{len(items)} items ({PROMPTS} prompts x {GROUP}), 30% duplicates in their group; medians of {repeat}")
    print("| run | judge calls | x baseline | time to rewards (s) | x cold | us an item |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, runs in figures.items():
        calls, seconds = statistics.median(x[0] for x in runs), statistics.median(x[1] for x in runs)
        print(f"| {name} | {calls:.0f} | {calls / base_calls:.2f}x | {seconds:.3f} | {seconds / cold_seconds:.3f}x "
              f"| {seconds / len(items) * 1e6:.1f} |")
    print(f"(baseline time {base_seconds:.3f} s; rewards identical in every run)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    asyncio.run(main(parser.parse_args().repeat))
