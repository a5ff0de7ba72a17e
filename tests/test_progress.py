"""``engine score``'s progress and summary: the bar moves as rows finish inside a chunk, an error is said below the
bar's last redraw, no line says "scored 0" before anything was, and every summary (fresh, resumed, after an
older version's state) says the rows of this run and of the output, the time, and the rewards' distribution.

The bar is rich's own, drawn by a real ``python -m engine score`` into a pipe that rich is told is a terminal
(``TTY_COMPATIBLE``, ``TTY_INTERACTIVE``: rich's switches for a terminal it cannot detect); the endpoint is a
real HTTP server on 127.0.0.1 that answers each row the reward its task names, holding a row until the test
releases it. Runs that end by themselves and whose process is not the point run in-process.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import polling
import pytest
from cli_support import (
    PLUGIN_ENV,
    RUN_TIMEOUT,
    Ran,
    Workspace,
    make_workspace,
    reaped,
    records,
    rows,
    state_of,
    write_rows,
)
from conftest import add_endpoint_env
from polling import wait_until
from servers import Request, Response, Server

from engine._backfill.checkpoint import state_path
from engine._backfill.rewards import Rewards

pytestmark = pytest.mark.timeout(60)

TERMINAL = {"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"}  # rich draws its live bar though stderr is a pipe
ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# one histogram row: its label, its bar, its count and share
HISTOGRAM_ROW = re.compile(r"^\s*(< 0|> 1|\[\d\.\d, \d\.\d[)\]])\s+█*\s*([\d,]+) \(\d+%\)$")


class Rewarder:
    """An endpoint answering each row ``task["reward"]``; a row whose task has ``"hold": true`` waits for
    :meth:`release` first."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def release(self) -> None:
        self.released.set()

    async def __call__(self, request: Request) -> Response:
        task = request.json()["task"]
        if task.get("hold"):
            await polling.eventually(self.released.is_set, RUN_TIMEOUT, "the held row was never released")
        return Response.json({"reward": task["reward"]})


@pytest.fixture
def rewarder() -> Iterator[tuple[Rewarder, Server]]:
    handler = Rewarder()
    with Server(handler) as server:
        yield handler, server
        handler.release()  # a test that failed half-way: its held request ends with the server


def endpoint_rows(rewards: list[float], hold: int | None = None) -> list[dict[str, Any]]:
    """A row per reward, of the ``remote`` environment; row ``hold`` is held until released."""
    return [
        {"id": f"r{n}", "environment": "remote", "task": {"reward": reward, **({"hold": True} if n == hold else {})},
         "trajectory": "t"}
        for n, reward in enumerate(rewards)
    ]


def remote_space(tmp_path: Path, server: Server) -> Workspace:
    space = make_workspace(tmp_path, PLUGIN_ENV)
    add_endpoint_env(space.envs, "remote", f"{server.url}/score")
    return space


class Reader:
    """A pipe read to its end in a thread, so that a test can wait for what it has said so far."""

    def __init__(self, stream: Any) -> None:
        self.parts: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for chunk in iter(lambda: stream.read(1), ""):
            self.parts.append(chunk)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def rest(self) -> str:
        self._thread.join(RUN_TIMEOUT)
        return self.text


def histogram(stdout: str) -> dict[str, int]:
    """The rows of the summary's histogram of rewards: each label's count."""
    found = (HISTOGRAM_ROW.match(line.rstrip()) for line in stdout.splitlines())
    return {m[1]: int(m[2].replace(",", "")) for m in found if m}


def test_the_bar_moves_as_rows_finish_inside_a_chunk(tmp_path: Path, rewarder: tuple[Rewarder, Server]) -> None:
    handler, server = rewarder
    space = remote_space(tmp_path, server)
    inp = write_rows(space.root / "in.jsonl", endpoint_rows([0.5] * 40, hold=39))  # one chunk (1,024 rows a chunk)

    process = space.start("score", inp, "-o", space.root / "out.jsonl", "--config", space.config, env=TERMINAL)
    with process, reaped(process):  # the outer one closes its pipes
        stderr = Reader(process.stderr)
        # the chunk cannot end before the held row does: the bar says 39 of its 40 rows while it waits
        wait_until(lambda: "39/40" in stderr.text or process.poll() is not None, RUN_TIMEOUT,
                   "the bar never said 39/40 while the last row was held")
        assert process.poll() is None, stderr.text
        handler.release()
        process.wait(timeout=RUN_TIMEOUT)  # its stdout, a summary, fits in the pipe
        assert process.stdout is not None
        out, err = process.stdout.read(), stderr.rest()

    assert process.returncode == 0, err
    assert "40 rewards written to" in out
    assert "\x1b[" in err  # it was rich's live bar, not plain lines


def test_an_error_is_said_below_the_bars_last_redraw(tmp_path: Path) -> None:
    space = make_workspace(tmp_path, PLUGIN_ENV)
    inp = write_rows(space.root / "in.jsonl", rows(5, poison=[2]))  # the backfill plugin fails row 2

    process = space.start("score", inp, "-o", space.root / "out.jsonl", "--config", space.config, env=TERMINAL)
    with reaped(process):
        _, stderr = process.communicate(timeout=RUN_TIMEOUT)

    assert process.returncode == 1, stderr
    assert "scoring" in stderr and "\x1b[" in stderr  # the bar was drawn
    said = ESCAPE.sub("", stderr[stderr.index("error: ") :])
    assert "poisoned" in said
    assert "scoring" not in said  # the bar was not drawn again below the error


def test_the_summary_says_the_rows_the_time_and_the_rewards_distribution(
    tmp_path: Path, rewarder: tuple[Rewarder, Server]
) -> None:
    _, server = rewarder
    space = remote_space(tmp_path, server)
    rewards = [0.0, 0.0, 1.0, 1.0, 1.0, 0.25, 0.25, 0.5, -0.5, 1.5]
    inp = write_rows(space.root / "in.jsonl", endpoint_rows(rewards))
    out = space.root / "out.jsonl"

    process = space.start("score", inp, "-o", out, "--config", space.config)  # off a terminal: plain lines
    with reaped(process):
        stdout, stderr = process.communicate(timeout=RUN_TIMEOUT)

    assert process.returncode == 0, stderr
    assert [r.reward for r in records(out)] == rewards
    assert stderr.splitlines()[0] == "scoring 10 rows"  # what is about to happen, never "scored 0/10 rows"
    assert "scored 0" not in stderr
    assert "per verifier, all 10 rows" in stdout
    assert "rewards of all 10 rows: mean 0.5000, exactly 0.0: 2 (20.0%), exactly 1.0: 3 (30.0%), min -0.5, " \
           "max 1.5" in stdout
    assert histogram(stdout) == {"< 0": 1, "[0.0, 0.1)": 2, "[0.1, 0.2)": 0, "[0.2, 0.3)": 2, "[0.3, 0.4)": 0,
                                 "[0.4, 0.5)": 0, "[0.5, 0.6)": 1, "[0.6, 0.7)": 0, "[0.7, 0.8)": 0,
                                 "[0.8, 0.9)": 0, "[0.9, 1.0]": 3, "> 1": 1}
    took = re.search(r"^scored 10 rows in ([\d.]+) s \(([\d,]+) rows/s\)$", stdout, re.MULTILINE)
    assert took is not None, stdout
    assert float(took[1]) > 0
    assert stdout.rstrip().endswith(f"10 rewards written to {out}")


def test_one_row_is_one_reward_and_rewards_all_0_or_1_need_no_histogram(
    tmp_path: Path, rewarder: tuple[Rewarder, Server]
) -> None:
    _, server = rewarder
    space = remote_space(tmp_path, server)
    inp = write_rows(space.root / "in.jsonl", endpoint_rows([1.0]))
    out = space.root / "out.jsonl"

    ran = ok(space.score(inp, out))

    assert ran.stderr.splitlines()[0] == "scoring 1 row"
    assert "rewards of the 1 row: mean 1.0000, exactly 0.0: 0 (0.0%), exactly 1.0: 1 (100.0%), min 1, max 1" \
        in ran.stdout
    assert histogram(ran.stdout) == {}
    assert re.search(r"^scored 1 row in [\d.]+ s", ran.stdout, re.MULTILINE), ran.stdout
    assert ran.stdout.rstrip().endswith(f"1 reward written to {out}")


def ok(result: Ran) -> Ran:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def failed_part_way(space: Workspace, count: int, poison: int) -> tuple[Path, Path, int]:
    """A run of ``count`` backfill rows, chunks of 10, that failed at row ``poison``: its input, output, rows done."""
    inp = write_rows(space.root / "in.jsonl", rows(count, poison=[poison]))
    out = space.root / "out.jsonl"
    assert space.score(inp, out, "--chunk-size", "10").returncode == 1
    return inp, out, int(state_of(out)["rows_done"])


def mean_line(rewards: list[float], which: str) -> str:
    return f"rewards of {which}: mean {math.fsum(rewards) / len(rewards):.4f}, exactly 0.0: 0 (0.0%), "


def test_a_resume_summarises_the_whole_output_and_the_rows_this_run_scored(tmp_path: Path) -> None:
    space = make_workspace(tmp_path, PLUGIN_ENV)
    inp, out, done = failed_part_way(space, 50, poison=35)
    assert done == 30
    fixed = space.root / "fixed"
    fixed.touch()

    resumed = ok(space.score(inp, out, "--chunk-size", "10", "--resume", env={"ENGINE_TEST_FIXED": str(fixed)}))

    assert resumed.stderr.splitlines()[0] == "resuming at row 30: 20 of 50 rows to score"
    rewards = [r.reward for r in records(out)]
    assert mean_line(rewards, "all 50 rows") in resumed.stdout
    assert f"min {min(rewards):g}, max {max(rewards):g}" in resumed.stdout
    assert sum(histogram(resumed.stdout).values()) == 50
    assert "per verifier, all 50 rows" in resumed.stdout
    assert re.search(r"^scored 20 rows in [\d.]+ s", resumed.stdout, re.MULTILINE), resumed.stdout
    assert f"50 rewards written to {out} (resumed at row 30)" in resumed.stdout


def test_a_resume_of_a_state_without_a_distribution_says_which_rows_it_has(tmp_path: Path) -> None:
    space = make_workspace(tmp_path, PLUGIN_ENV)
    inp, out, done = failed_part_way(space, 50, poison=35)
    state = state_of(out)
    del state["meta"]["rewards"]  # as a run of an older version left it
    state_path(out).write_bytes(orjson.dumps(state))
    fixed = space.root / "fixed"
    fixed.touch()

    resumed = ok(space.score(inp, out, "--chunk-size", "10", "--resume", env={"ENGINE_TEST_FIXED": str(fixed)}))

    later = [r.reward for r in records(out)][done:]
    assert mean_line(later, "20 of the 50 rows (those an older version scored before the resume not known)") \
        in resumed.stdout
    assert sum(histogram(resumed.stdout).values()) == 20
    assert f"50 rewards written to {out} (resumed at row 30)" in resumed.stdout


@pytest.mark.parametrize("case", ["not an object", "counts that do not add up", "a count as text", "min above max"])
def test_a_hand_edited_distribution_in_the_state_is_refused(tmp_path: Path, case: str) -> None:
    space = make_workspace(tmp_path, PLUGIN_ENV)
    inp, out, _ = failed_part_way(space, 50, poison=35)
    state = state_of(out)
    kept = state["meta"]["rewards"]
    state["meta"]["rewards"] = {
        "not an object": [1, 2],
        "counts that do not add up": {**kept, "count": kept["count"] + 1},
        "a count as text": {**kept, "zeros": str(kept["zeros"])},
        "min above max": {**kept, "min": kept["max"] + 1},
    }[case]
    state_path(out).write_bytes(orjson.dumps(state))

    refused = space.score(inp, out, "--chunk-size", "10", "--resume")

    assert refused.returncode == 2, refused.stderr
    assert f"{state_path(out)}: unusable state file: field 'meta.rewards' is not a distribution of rewards" \
        in refused.stderr
    assert refused.stderr.rstrip().endswith("delete it to start over")


def test_a_sum_of_rewards_that_overflows_is_kept_and_resumed_as_unknown() -> None:
    """Two finite rewards of 1e308 sum past a float: the state (JSON, which has no infinity) must still resume."""
    rewards = Rewards()
    rewards.add([1e308, 1e308, 0.5])
    assert rewards.mean == math.inf and (rewards.low, rewards.high) == (0.5, 1e308)
    kept = orjson.loads(orjson.dumps(rewards.to_json()))
    back = Rewards.from_json(kept)
    assert math.isnan(back.mean)
    assert (back.count, back.bins[5], back.above, back.low, back.high) == (3, 1, 2, 0.5, 1e308)
