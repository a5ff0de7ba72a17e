"""The public API, pinned: the names ``engine/__init__.pyi`` imports (``engine.__all__``) are the whole of it, and
every module behind it is private.

A user imports from ``engine`` and nothing else; a name of the stub's that does not resolve to its module's
own object, an error class left out of it, or a module reachable without a leading underscore fails here first.
The modules with a public name are ``engine.cli``, the ``engine`` command's (``engine.__main__``
imports it under its Ctrl-C handling): a command line, not a Python API, and not in ``__all__``;
``engine.adapters``, the trainer adapters, which a trainer's config names by their module path; and
``engine.ray``, the API that needs the ``ray`` extra (``import engine`` never imports Ray).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import orjson
import pytest
from cli_support import child_env

import engine
import engine._errors

STUB = Path(engine.__file__).with_name("__init__.pyi")  # the one list of the public names, with their modules


def stub_imports() -> list[tuple[str, str, str | None]]:
    """``(module, name, alias)`` for each name the stub imports, as a type checker reads them."""
    tree = ast.parse(STUB.read_text())
    found = []
    for node in tree.body:
        assert isinstance(node, ast.ImportFrom), ast.dump(node)  # the stub holds imports only
        found += [(str(node.module), alias.name, alias.asname) for alias in node.names]
    return found


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


def test_all_is_the_stubs_names_each_exported_from_a_private_module() -> None:
    imports = stub_imports()
    assert len(imports) >= 29  # the stub was read: engine had 29 public names when it became the list
    for module, name, alias in imports:
        assert alias == name, (module, name, alias)  # ``X as X``: exported, for a type checker too
        assert module.startswith("engine._"), module
    names = [name for _, name, _ in imports]
    assert engine.__all__ == sorted(names)
    assert len(set(engine.__all__)) == len(engine.__all__)


def test_every_public_name_is_its_modules_own_object_and_star_and_dir_give_exactly_them() -> None:
    for module, name, _ in stub_imports():
        assert getattr(engine, name) is getattr(importlib.import_module(module), name), name
    namespace: dict[str, object] = {}
    exec("from engine import *", namespace)
    assert sorted(set(namespace) - {"__builtins__"}) == engine.__all__
    assert [name for name in dir(engine) if not name.startswith("_")] == engine.__all__
    assert "__all__" in dir(engine)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NotAName"):
        engine.NotAName  # type: ignore[attr-defined]  # noqa: B018


def test_public_classes_and_functions_are_the_packages_own() -> None:
    """Each comes from a private module of the package: none is a foreign library's re-exported."""
    for name in engine.__all__:
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
imported = sorted(name for name in sys.modules if name.startswith("engine."))
namespace = {}
exec("from engine import *", namespace)  # before any name was used: __all__ and every name, on demand
starred = sorted(set(namespace) - {"__builtins__"})
for name in engine.__all__:
    getattr(engine, name)
public = [name for name in dir(engine) if not name.startswith("_") and inspect.ismodule(getattr(engine, name))]
sys.stdout.write(orjson.dumps([imported, starred == engine.__all__, public]).decode())
"""


def test_the_public_api_is_imported_on_demand_and_exposes_no_module() -> None:
    """In a fresh process, ``import engine`` imports none of its modules; ``from engine import *`` gives every
    public name; and ``dir(engine)`` then shows no module without an underscore, every public name resolved."""
    command = [sys.executable, "-c", PROBE]
    done = subprocess.run(command, env=child_env(None), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert orjson.loads(done.stdout) == [[], True, []]
