"""Importing a plugin environment's code: from its pinned source files only, under a private name.

Each environment is imported as a package of its own, ``_engine_env_<n>_<name>``, so two
environments that both ship ``verify.py`` each get theirs, and a plugin reaches its sibling files
with relative imports (``from . import helpers``).

Only ``.py`` sources are ever read, and compiled fresh: never a ``__pycache__`` entry or a stray
``.pyc``, which the digest does not cover (Python would otherwise run a planted ``.pyc`` whose
header matches the source's mtime and size, code nobody vetted). Nothing is written next to the
environment's files either.

:func:`load_callable` is the whole import of a plugin, shared by the engine's own process (thread
executor) and its worker processes (process executor), so both say the same thing when it fails.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import re
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

from .errors import describe

__all__ = ["PluginLoadError", "import_from_environment", "load_callable"]

_numbers = itertools.count()


class _SourceLoader(importlib.machinery.SourceFileLoader):
    """A source loader that ignores (and never writes) bytecode caches."""

    def get_code(self, fullname: str) -> CodeType:
        path = self.get_filename(fullname)
        return compile(self.get_data(path), path, "exec", dont_inherit=True)


class _EnvironmentFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of the private environment packages, in their directories, as sources."""

    def __init__(self) -> None:
        self.roots: dict[str, Path] = {}
        self._lock = threading.Lock()

    def add(self, package: str, root: Path) -> None:
        with self._lock:
            self.roots[package] = root

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, rest = fullname.partition(".")
        root = self.roots.get(package)
        if root is None or not rest:
            return None
        base = root.joinpath(*rest.split("."))
        init, source = base / "__init__.py", base.with_name(base.name + ".py")
        if init.is_file():
            return importlib.util.spec_from_file_location(
                fullname, init, loader=_SourceLoader(fullname, str(init)), submodule_search_locations=[]
            )
        if source.is_file():
            return importlib.util.spec_from_file_location(fullname, source, loader=_SourceLoader(fullname, str(source)))
        # Not None: the standard finders would go on to look for bytecode or extension modules.
        reason = f"no module named {rest!r} in {root} (plugins are imported from .py files only)"
        raise ModuleNotFoundError(reason, name=fullname)


_finder = _EnvironmentFinder()
sys.meta_path.insert(0, _finder)


def import_from_environment(root: Path, name: str, module: str) -> Any:
    """Import ``module`` (dotted) from environment directory ``root`` under a fresh private package."""
    safe = re.sub(r"\W", "_", name)
    package = f"_engine_env_{next(_numbers)}_{safe}"
    # An empty __path__: its submodules are found by _finder alone, never by the path-based finders.
    spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
    sys.modules[package] = importlib.util.module_from_spec(spec)
    _finder.add(package, root)
    try:
        return importlib.import_module(f"{package}.{module}")
    except BaseException:
        sys.modules.pop(package, None)
        raise


class PluginLoadError(Exception):
    """A plugin's module or callable cannot be loaded; ``reason`` says why (the cause is chained)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


def load_callable(root: Path, name: str, ref: str) -> Callable[..., Any]:
    """The callable ``ref`` (``module:attr``, both dotted) of environment ``name`` in directory ``root``.

    The caller has checked the directory's digest. Raises :class:`PluginLoadError`; a module whose
    import raises, even ``SystemExit``, is a load error, not the end of the process.
    """
    module_name, _, attr_path = ref.partition(":")
    try:
        target: Any = import_from_environment(root, name, module_name)
    except (Exception, SystemExit) as exc:
        raise PluginLoadError(f"cannot import module {module_name!r}: {describe(exc)}") from exc
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise PluginLoadError(f"module {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(target):
        raise PluginLoadError(f"{attr_path!r} in module {module_name!r} is a {type(target).__name__}, not callable")
    fn: Callable[..., Any] = target
    return fn
