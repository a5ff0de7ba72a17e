"""The public API, pinned: ``engine.__all__`` is the whole of it, and every module behind it is private.

A user imports from ``engine`` and nothing else; a name added to or dropped from ``__all__``, an
error class left out of it, or a module reachable without a leading underscore fails here first.
The modules with a public name are ``engine.cli``, the ``engine`` command's (``engine.__main__``
imports it under its Ctrl-C handling): a command line, not a Python API, and not in ``__all__``;
``engine.adapters``, the trainer adapters, which a trainer's config names by their module path; and
``engine.ray``, the API that needs the ``ray`` extra (``import engine`` never imports Ray).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
from types import ModuleType

import orjson
import pytest
from cli_support import child_env

import engine
import engine._errors

PUBLIC = [
    "KINDS",
    "AsyncVerifyFn",
    "BatchResult",
    "BlockingEngine",
    "ConfigError",
    "DigestError",
    "Engine",
    "EngineConfig",
    "EngineError",
    "Environment",
    "InputError",
    "JudgeConfig",
    "Limits",
    "ManifestError",
    "OutputError",
    "ResumeError",
    "RewardRecord",
    "RubricError",
    "ServiceError",
    "VerificationError",
    "VerifierReport",
    "VerifierSpec",
    "VerifyFn",
    "WriteError",
    "digest_directory",
    "flatten",
    "load_config",
    "load_environment",
    "read_rewards",
]
# the engine command's modules (``engine.__main__`` is never imported here), the trainer adapters, and engine.ray:
# the API that needs the ray extra, a module of its own so that ``import engine`` never imports Ray
PUBLIC_MODULES = {"cli", "__main__", "adapters", "ray"}


def submodule_names() -> list[str]:
    """Every module of the package, by its full name (imports the packages, to look inside them)."""
    return [info.name for info in pkgutil.walk_packages(engine.__path__, prefix="engine.")]


def all_modules() -> list[ModuleType]:
    """Every module of the package but ``engine.__main__`` (importing it is harmless, but it is the command)."""
    return [engine, *(importlib.import_module(name) for name in submodule_names() if name != "engine.__main__")]


def subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    for sub in list(found):
        found |= subclasses(sub)
    return found


def test_all_is_the_public_api() -> None:
    assert engine.__all__ == PUBLIC
    assert len(set(engine.__all__)) == len(engine.__all__)


def test_every_public_name_resolves_and_star_gives_exactly_them() -> None:
    for name in PUBLIC:
        assert getattr(engine, name) is not None, name
    namespace: dict[str, object] = {}
    exec("from engine import *", namespace)
    assert sorted(set(namespace) - {"__builtins__"}) == sorted(PUBLIC)
    assert set(PUBLIC) <= set(dir(engine))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NotAName"):
        engine.NotAName  # type: ignore[attr-defined]  # noqa: B018


def test_public_classes_and_functions_are_the_packages_own() -> None:
    """Each comes from a private module of the package: none is a foreign library's re-exported."""
    for name in PUBLIC:
        value = getattr(engine, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert value.__module__.startswith("engine._"), (name, value.__module__)


def test_every_public_error_lives_in_errors_and_is_exported() -> None:
    """Every EngineError subclass the package defines, anywhere in it, is in ``engine._errors`` and in ``__all__``."""
    all_modules()  # every subclass the package defines is now defined
    ours = {error for error in subclasses(engine.EngineError) if error.__module__.split(".")[0] == "engine"}
    errors = {engine.EngineError, *ours}  # (a test may define subclasses of its own)
    assert {error.__module__ for error in errors} == {"engine._errors"}, sorted(map(repr, errors))
    for error in errors:
        assert error.__name__ in engine.__all__, error
        assert getattr(engine, error.__name__) is error


def test_every_engine_error_in_errors_is_exported() -> None:
    declared = {
        name
        for name, value in vars(engine._errors).items()
        if inspect.isclass(value) and issubclass(value, engine.EngineError)
    }
    assert declared, "engine._errors declares no EngineError"
    assert declared <= set(engine.__all__), declared - set(engine.__all__)
    assert {name for name in engine.__all__ if name.endswith("Error")} == declared


def test_no_module_is_public_but_the_commands() -> None:
    names = submodule_names()
    assert "engine.cli" in names and "engine._errors" in names  # the walk did see the package
    for name in names:
        first = name.split(".")[1]
        assert first.startswith("_") or first in PUBLIC_MODULES, name
    all_modules()
    exposed = {name for name in dir(engine) if not name.startswith("_") and inspect.ismodule(getattr(engine, name))}
    # a submodule, once imported, is an attribute of its package: these alone
    assert exposed <= {"cli", "adapters", "ray"}, exposed


PROBE = """
import inspect, sys
import orjson
import engine
for name in engine.__all__:
    getattr(engine, name)
public = [name for name in dir(engine) if not name.startswith("_") and inspect.ismodule(getattr(engine, name))]
sys.stdout.write(orjson.dumps(public).decode())
"""


def test_the_public_api_exposes_no_module() -> None:
    """In a fresh process, ``dir(engine)`` shows no module without an underscore, every public name resolved."""
    command = [sys.executable, "-c", PROBE]
    done = subprocess.run(command, env=child_env(None), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert orjson.loads(done.stdout) == []
