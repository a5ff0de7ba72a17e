"""Environment-level failures (a pin that does not match, a module that does not import) name the
environment and its FIRST item in input order, the same item every run, however its calls race."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
from asserts import check_error
from conftest import add_env, item, process_twin

from engine import BlockingEngine, EngineConfig, Limits, VerificationError, digest_directory

check = partial(check_error, kind="plugin", ref="verify:score")
RUNS = 3  # each layout is scored this many times, each run by a new engine (nothing imported yet)
NOTE = "cannot load its verifier, so none of its items can be scored; the error names the first of them in the batch"


def _slow_first_import(envs: Path, name: str, marker: Path, **verifier: Any) -> str:
    """A plugin environment whose module never imports: the first import to start waits before it fails,
    every later one fails at once; so of several imports racing, the first started fails last."""
    add_env(envs, name, "plugin", "verify:score")
    (envs / name / "verify.py").write_text(
        "import os, time\n"
        "try:\n"
        f"    os.close(os.open({str(marker)!r}, os.O_CREAT | os.O_EXCL))\n"
        "    time.sleep(0.5)\n"
        "except FileExistsError:\n"
        "    pass\n"
        "raise ImportError('this environment never imports')\n"
    )
    if verifier:
        process_twin(envs, name, f"{name}_p", **verifier)
        return f"{name}_p"
    return name


def _batches(ok: str, bad: str) -> list[list[dict[str, Any]]]:
    """Layouts where several items of ``bad`` would run at once: grouped lanes, a guessed lane, ids."""
    return [
        [item(ok), *[item(bad, item_id=f"b{i}") for i in range(1, 9)]],  # first bad: 1
        [item(ok), item(ok), item(bad, item_id="b2"), item(ok), *[item(bad) for _ in range(6)], item(ok)],  # 2
        [*[item(ok) if i % 3 else item(bad, item_id=f"b{i}") for i in range(1, 40)], item(ok)],  # 3, guessed lane
    ]


def _first_bad(batch: list[dict[str, Any]], bad: str) -> int:
    return next(i for i, it in enumerate(batch) if it["environment"] == bad)


def _named(config: EngineConfig, batch: list[dict[str, Any]], first_index: int = 0) -> VerificationError:
    with BlockingEngine(config) as eng, pytest.raises(VerificationError) as info:
        eng.score(batch, first_index=first_index)
    return info.value


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_an_import_error_names_the_first_item_of_its_environment(
    envs: Path, tmp_path: Path, executor: str
) -> None:
    """Several imports race (a worker process per call in flight under the process executor), and the
    first started fails last: whichever call fails first, the environment's first item is named."""
    for run in range(RUNS):
        for number, batch in enumerate(_batches("twin_a", "bad")):
            marker = tmp_path / f"marker-{executor}-{run}-{number}"
            extra = {"executor": "process", "workers": 4} if executor == "process" else {}
            name = _slow_first_import(envs, f"slow_{executor}_{run}_{number}", marker, **extra)
            batch = [dict(it, environment=name) if it["environment"] == "bad" else it for it in batch]
            config = EngineConfig(environments=envs, allow_unpinned=True, defaults=Limits(timeout=30))
            err = _named(config, batch, first_index=100)
            index = _first_bad(batch, name)
            check(err, environment=name, index=100 + index, item_id=batch[index].get("id"), match=".*never imports.*")
            assert any(NOTE in note for note in getattr(err, "__notes__", [])), err


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_pin_mismatch_names_the_first_item_of_its_environment(envs: Path, executor: str) -> None:
    name = "arith" if executor == "thread" else process_twin(envs, "arith", workers=4)
    stale = "sha256:" + "0" * 64
    assert digest_directory(envs / name) != stale
    config = EngineConfig(environments=envs, pins={name: stale, "twin_a": digest_directory(envs / "twin_a")})
    for _ in range(RUNS):
        for batch in _batches("twin_a", name):
            err = _named(config, batch)
            index = _first_bad(batch, name)
            stale_pin = "changed since it was pinned"
            check(err, environment=name, index=index, item_id=batch[index].get("id"), reason=stale_pin)

