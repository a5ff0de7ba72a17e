"""Fixtures the trainers' modules import (not a conftest.py: one here would take the module name ``conftest``
from ``tests/conftest.py``, whose helpers the modules import): the adapter configured either way, in process
(``ENGINE_CONFIG``) or against a real ``engine serve`` (``ENGINE_URL``), over the test environments and the
project's ``examples/envs/arithmetic``."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_serve import Service, servable, start_service, stop

from engine.adapters import close_engines

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def envs_with_arithmetic(envs: Path) -> Path:
    """The test environments and the project's own examples/envs/arithmetic."""
    shutil.copytree(ROOT / "examples" / "envs" / "arithmetic", envs / "arithmetic")
    return envs


@pytest.fixture
def in_process(envs_with_arithmetic: Path, engine_toml: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_CONFIG", str(engine_toml))
    monkeypatch.delenv("ENGINE_URL", raising=False)
    monkeypatch.delenv("ENGINE_ENVIRONMENT", raising=False)


@pytest.fixture
def served(envs_with_arithmetic: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Service]:
    servable(envs_with_arithmetic)
    service = start_service(tmp_path, "")
    monkeypatch.setenv("ENGINE_URL", service.url)
    monkeypatch.delenv("ENGINE_CONFIG", raising=False)
    monkeypatch.delenv("ENGINE_ENVIRONMENT", raising=False)
    yield service
    close_engines()
    stop(service)


@pytest.fixture(params=["ENGINE_CONFIG", "ENGINE_URL"])
def configured(request: pytest.FixtureRequest) -> str:
    """The adapter configured either way: in process, or against a real ``engine serve``."""
    request.getfixturevalue("in_process" if request.param == "ENGINE_CONFIG" else "served")
    return str(request.param)
