"""The site's pages, and the README, run as a reader follows them: every block, in order, in a fresh directory.

A page's fenced blocks are its script (docs/design.md, "The documentation site"): a block with a
``title="path"`` is a file the reader writes; an ``sh`` block's lines are commands, each expected to
exit 0 unless it ends with ``# exits N``; a ``python`` block is run as a script of its own, and a line
``print(...)  # text`` expects ``text`` as its output line; ``json`` and ``toml`` blocks must parse; a
block after ``<!-- not run: reason -->`` is skipped. The trainer pages are run by the trainers suite.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent
# the trainer pages are the trainers suite's (their blocks need each trainer's venv)
PAGES = [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if p.parent.name != "trainers")]

FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^`\n]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
SKIP = re.compile(r"<!--\s*not run:\s*(?P<why>[^>]*?)\s*-->\s*$")
EXITS = re.compile(r"\s+#\s*exits (?P<code>\d+)\b.*$")
PRINTED = re.compile(r"^\s*print\(.*\)\s+#\s?(?P<expected>.*)$")


@dataclass(frozen=True)
class Block:
    language: str
    title: str | None
    body: str
    line: int  # where the block's fence is, for the failure's message
    skipped: str | None


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        info = match["info"].strip()
        language = info.split()[0].strip("{}. ") if info else ""
        title = re.search(r'title="([^"]+)"', info)
        indent = len(match["indent"])
        body = "\n".join(line[indent:] for line in match["body"].splitlines()) + "\n"
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skipped = SKIP.search(before)
        found.append(Block(language, title[1] if title else None, body, text.count("\n", 0, match.start()) + 1,
                           skipped["why"] if skipped else None))
    return found


def commands(body: str) -> list[str]:
    """An sh block's commands: its lines, a trailing backslash joining the next, comments-only lines left out."""
    joined = body.replace("\\\n", " ")
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


PORT = re.compile(r"\b18\d{3}\b")  # the pages' ports: fixed for the reader, free ones for each run here


def free_ports(text: str) -> dict[str, str]:
    """A free port for each of the page's: two copies of the suite side by side must not meet on one."""
    ports = {}
    for port in sorted(set(PORT.findall(text))):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports[port] = str(probe.getsockname()[1])
    return ports


def run_page(page: Path, workspace: Path) -> None:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "COLUMNS": "120", "NO_COLOR": "1"}
    started: list[subprocess.Popen[bytes]] = []  # an sh line ending in & : a server the page starts
    ports = free_ports(page.read_text())
    try:
        for found in blocks(page):
            block = dataclasses.replace(found, body=PORT.sub(lambda m: ports[m[0]], found.body))
            where = f"{page.name}:{block.line}"
            if block.skipped is not None:
                assert block.skipped, f"{where}: a block not run says why"
                continue
            if block.title is not None:
                path = workspace / block.title
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(block.body)
            if block.language == "json" and block.title is not None and block.title.endswith(".jsonl"):
                for line in block.body.splitlines():
                    json.loads(line)
            elif block.language == "json":
                json.loads(block.body)
            elif block.language == "toml":
                tomllib.loads(block.body)
            elif block.language == "sh":
                for command in commands(block.body):
                    run_command(command, workspace, env, where, started)
            elif block.language == "python" and block.title is None:
                run_python(block.body, workspace, env, where)
    finally:
        for process in started:
            with_group_ended(process)


def run_command(command: str, workspace: Path, env: dict[str, str], where: str,
                started: list[subprocess.Popen[bytes]]) -> None:
    expected = EXITS.search(command)
    code = int(expected["code"]) if expected else 0
    line = EXITS.sub("", command).strip()
    if line.endswith("&"):
        started.append(subprocess.Popen(["bash", "-c", line[:-1]], cwd=workspace, env=env, start_new_session=True,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return
    result = subprocess.run(["bash", "-c", line], cwd=workspace, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == code, f"{where}: {line!r} exited {result.returncode}, not {code}:\n" \
                                      f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}"


def run_python(body: str, workspace: Path, env: dict[str, str], where: str) -> None:
    result = subprocess.run([sys.executable, "-c", body], cwd=workspace, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"{where}: the block failed:\n{result.stderr[-3000:]}"
    expected = [m["expected"] for m in map(PRINTED.match, body.splitlines()) if m]
    if expected:
        assert result.stdout.splitlines() == expected, f"{where}: printed {result.stdout!r}"


def with_group_ended(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


# a page is a reader's whole session: a dozen engine commands, servers started and stopped, on a loaded machine
PAGE_TIMEOUT = 300.0


PAGE_IDS = [str(p.relative_to(DOCS if p.is_relative_to(DOCS) else ROOT)) for p in PAGES]


@pytest.mark.timeout(PAGE_TIMEOUT)
@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_every_block_of_the_page_runs_as_a_reader_follows_it(page: Path, tmp_path: Path) -> None:
    run_page(page, tmp_path)


def test_the_quick_start_reaches_the_readers_own_rewards(tmp_path: Path) -> None:
    """Followed from an empty directory, the quick start's own files give its rows' rewards, in order."""
    began = time.monotonic()
    run_page(DOCS / "quickstart.md", tmp_path)
    records = [json.loads(line) for line in (tmp_path / "rewards.jsonl").read_text().splitlines()]
    assert [(r["id"], r["reward"]) for r in records] == [(1, 1.0), (2, 0.0), (3, 1.0)]
    assert {r["verifier"]["environment"] for r in records} == {"exact"}
    print(f"the quick start's steps ran in {time.monotonic() - began:.1f} s")  # for the record, never asserted


def test_the_harness_refuses_what_a_page_gets_wrong(tmp_path: Path) -> None:
    """A page whose command fails, whose printed line differs or whose file does not parse fails its test."""
    cases = {
        "```sh\nfalse\n```\n": "exited 1, not 0",
        "```sh\ntrue    # exits 3\n```\n": "exited 0, not 3",
        "```python\nprint(1 + 1)  # 3\n```\n": "printed",
        '```json title="x.json"\n{"a": \n```\n': "Expecting value",
        "<!-- not run: -->\n```sh\ntrue\n```\n": "says why",
    }
    for text, message in cases.items():
        page = tmp_path / "page.md"
        page.write_text(text)
        with pytest.raises((AssertionError, ValueError)) as caught:
            run_page(page, tmp_path)
        assert message in str(caught.value), (text, caught.value)
