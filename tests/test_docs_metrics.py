"""The guides' reference tables hold to what the code exports, so they cannot drift.

docs/serve.md's table of ``/metrics`` names exactly the metric families a real ``engine serve`` exports,
each with its type, and the labels of every family that has samples once batches were scored and failed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cli_support import copy_env
from prometheus_client.parser import text_string_to_metric_families
from test_serve import Service, start_service, stop

import engine

pytestmark = pytest.mark.timeout(90)  # a service is a process: slow to start on a loaded 2-core machine

SERVE_PAGE = Path(__file__).resolve().parent.parent / "docs" / "serve.md"
ROW = re.compile(r"^\|\s*`(?P<name>[a-z_]+)`\s*\|\s*(?P<type>\w+)\s*\|(?P<labels>[^|]*)\|")
TYPE_LINE = re.compile(r"^# TYPE (?P<name>\S+) (?P<type>\S+)$", re.M)


def page_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """The page's metrics table: each metric's name, as exported, to its type and its labels."""
    text = SERVE_PAGE.read_text()
    start = text.index("| metric | type | labels |")
    table = text[start:].split("\n\n", 1)[0].splitlines()[2:]  # past the header and its rule
    rows = [ROW.match(line) for line in table]
    assert all(rows), [line for line, row in zip(table, rows, strict=True) if row is None]
    return {
        row["name"]: (row["type"], frozenset(re.findall(r"`(\w+)`", row["labels"])))
        for row in rows
        if row is not None
    }


def exported(text: str) -> tuple[dict[str, str], dict[str, frozenset[str]]]:
    """From ``/metrics``' text: each family's name as exported (a counter's with ``_total``) to its type, and
    the labels its samples carry (a histogram's ``le`` aside), for the families that have samples."""
    types = {match["name"]: match["type"] for match in TYPE_LINE.finditer(text)}
    labels: dict[str, frozenset[str]] = {}
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if family.type == "counter" else family.name
        seen = {label for sample in family.samples for label in sample.labels if label != "le"}
        if family.samples:
            labels[name] = frozenset(seen)
    return types, labels


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("metrics")
    (root / "envs").mkdir()
    copy_env("arith", root / "envs")
    running = start_service(root, "")
    yield running
    code, err = stop(running)
    assert code == 0, err


def test_the_serve_page_names_every_metric_the_service_exports(service: Service) -> None:
    good = {"environment": "arith", "task": {"reference": "4"}, "trajectory": "4"}
    bad = {"environment": "arith", "task": {"prompt": "no reference"}, "trajectory": "4"}
    with engine.BlockingEngine.connect(service.url) as eng:
        assert eng.score([good, good]) == [1.0, 1.0]
        with pytest.raises(engine.VerificationError):
            eng.score([bad])
    types, labels = exported(httpx.get(service.url + "/metrics", timeout=30).text)
    documented = page_metrics()

    assert {name: kind for name, (kind, _) in documented.items()} == types
    # every family with samples carries the labels the page says; the verifier's own have samples by now,
    # so this is not a check of nothing
    assert {"engine_verifier_items_total", "engine_verifier_errors_total", "engine_verifier_latency_seconds"} <= set(
        labels
    )
    assert {name: documented[name][1] for name in labels} == labels


def test_the_table_reader_refuses_a_row_it_cannot_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row the reader cannot parse fails the check instead of dropping out of it unseen."""
    page = tmp_path / "serve.md"
    page.write_text("| metric | type | labels | what |\n| --- | --- | --- | --- |\n| engine_items | counter | | x |\n")
    monkeypatch.setattr(f"{__name__}.SERVE_PAGE", page)
    with pytest.raises(AssertionError):
        page_metrics()
