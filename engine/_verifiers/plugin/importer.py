"""Importing a plugin environment's code: from the snapshot its digest was checked on, under a private name.

Shared by the engine's process and its worker processes, so both say the same when an import fails; it
imports nothing a worker does not need. docs/design.md, "Plugin executors".
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import linecache
import re
import sys
import threading
from collections.abc import Callable, Sequence
from importlib.resources.abc import Traversable, TraversableResources
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

from engine._environments.digest import Snapshot
from engine._errors import Failure
from engine._reasons import a_or_an, describe

__all__ = ["PluginLoadError", "forget", "import_from_environment", "load_callable", "load_plugin", "safely_described"]

_numbers = itertools.count()


class _DataFiles(TraversableResources):
    """A package's data files (``importlib.resources``), on disk: the pin covers modules, not these."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def files(self) -> Traversable:
        return self.directory


class _SnapshotLoader(importlib.abc.InspectLoader):
    """Loads one module from the bytes of a snapshot, compiled fresh (no bytecode cache read or written)."""

    def __init__(self, path: str, source: bytes, package: bool) -> None:
        self.path = path
        self.source = source
        self.package = package

    def is_package(self, fullname: str) -> bool:
        return self.package

    def get_filename(self, fullname: str) -> str:
        return self.path

    def get_data(self, path: str) -> bytes:
        """A file next to the module (``pkgutil.get_data``), read from disk: the pin covers modules only."""
        if path == self.path:
            return self.source
        with open(path, "rb") as f:
            return f.read()

    def get_resource_reader(self, fullname: str) -> TraversableResources | None:
        return _DataFiles(Path(self.path).parent) if self.package else None

    def get_source(self, fullname: str) -> str:
        return importlib.util.decode_source(self.source)

    def get_code(self, fullname: str) -> CodeType:
        return compile(self.source, self.path, "exec", dont_inherit=True)

    def exec_module(self, module: ModuleType) -> None:
        # Tracebacks quote the lines that run, not the file on disk (which may differ by now): an
        # entry without an mtime is never checked against the disk (as for modules from zip files).
        lines = self.get_source(module.__name__).splitlines(keepends=True)
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        linecache.cache[self.path] = (len(self.source), None, lines, self.path)
        super().exec_module(module)


class _EnvironmentFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of the private environment packages, in their snapshots only."""

    def __init__(self) -> None:
        self.snapshots: dict[str, Snapshot] = {}
        self._lock = threading.Lock()

    def add(self, package: str, snapshot: Snapshot) -> None:
        with self._lock:
            self.snapshots[package] = snapshot
            if self not in sys.meta_path:  # on the first plugin import, not when the engine is imported
                sys.meta_path.insert(0, self)

    def remove(self, snapshot: Snapshot) -> list[str]:
        """Stop finding modules for the packages imported from ``snapshot``; their names."""
        with self._lock:
            packages = [package for package, mine in self.snapshots.items() if mine is snapshot]
            for package in packages:
                del self.snapshots[package]
        return packages

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, rest = fullname.partition(".")
        snapshot = self.snapshots.get(package)
        if snapshot is None or not rest:
            return None
        base = "/".join(rest.split("."))
        for relative, is_package in ((f"{base}/__init__.py", True), (f"{base}.py", False)):
            source = snapshot.sources.get(relative)
            if source is not None:
                origin = str(snapshot.root.joinpath(*relative.split("/")))
                loader = _SnapshotLoader(origin, source, is_package)
                spec = importlib.machinery.ModuleSpec(fullname, loader, origin=origin, is_package=is_package)
                spec.has_location = True  # sets __file__
                if is_package:  # empty: its submodules are found by this finder alone
                    spec.submodule_search_locations = []
                return spec
        # Not None: the standard finders would go on to look for bytecode or extension modules.
        reason = f"no module named {rest!r} in {snapshot.root} (plugins are imported from .py files only)"
        raise ModuleNotFoundError(reason, name=fullname)


_finder = _EnvironmentFinder()


def import_from_environment(snapshot: Snapshot, name: str, module: str) -> Any:
    """Import ``module`` (dotted) from ``snapshot`` of environment ``name``, under a fresh private package."""
    safe = re.sub(r"\W", "_", name)
    package = f"_engine_env_{next(_numbers)}_{safe}"
    # An empty __path__: its submodules are found by _finder alone, never by the path-based finders.
    spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
    sys.modules[package] = importlib.util.module_from_spec(spec)
    _finder.add(package, snapshot)
    try:
        return importlib.import_module(f"{package}.{module}")
    except BaseException:
        sys.modules.pop(package, None)
        raise


def forget(snapshot: Snapshot) -> None:
    """Unregister the private packages imported from ``snapshot``: this finder's entries, and their modules
    in ``sys.modules``, so an engine that closes leaves neither behind (a trainer may open hundreds).

    Module objects still referenced (by a call still running in an abandoned thread) stay alive; a
    module they import from then on is not found.
    """
    packages = set(_finder.remove(snapshot))
    if packages:
        for name in [name for name in list(sys.modules) if name.partition(".")[0] in packages]:
            sys.modules.pop(name, None)


class PluginLoadError(Failure):
    """A plugin's module or callable cannot be loaded; ``reason`` says why (the cause is chained)."""


def load_callable(snapshot: Snapshot, name: str, ref: str) -> Callable[..., Any]:
    """The callable ``ref`` (``module:attr``, both dotted) of environment ``name``, from ``snapshot``.

    The caller has checked the snapshot's digest. Raises :class:`PluginLoadError`; a module whose
    import raises, even ``SystemExit``, is a load error, not the end of the process.
    """
    module_name, _, attr_path = ref.partition(":")
    try:
        target: Any = import_from_environment(snapshot, name, module_name)
    except (Exception, SystemExit) as exc:
        raise PluginLoadError(f"cannot import module {module_name!r}: {describe(exc)}") from exc
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise PluginLoadError(f"module {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(target):
        what = a_or_an(type(target).__name__)
        raise PluginLoadError(f"{attr_path!r} in module {module_name!r} is {what}, not callable")
    fn: Callable[..., Any] = target
    return fn


def safely_described(exc: BaseException) -> str:
    """What ``describe`` says of a plugin's exception; never raises (its ``__str__`` is the plugin's code)."""
    try:
        return describe(exc)
    except KeyboardInterrupt:
        raise
    except BaseException:  # an exception whose __str__ raises, even SystemExit
        return type(exc).__name__


def load_plugin(snapshot: Snapshot, environment: str, ref: str) -> Callable[..., Any]:
    """:func:`load_callable`, and whatever else the plugin's code raises on its import or while its callable
    is looked up (a ``BaseException`` of its own, such as pytest's ``Skipped`` or ``func_timeout``'s
    ``FunctionTimedOut``) a :class:`PluginLoadError` too, the cause chained.

    Only ``KeyboardInterrupt`` passes: it is the user's, not the plugin's.
    """
    try:
        return load_callable(snapshot, environment, ref)
    except (PluginLoadError, KeyboardInterrupt):
        raise
    except BaseException as exc:
        raise PluginLoadError(f"cannot load {ref!r}: {safely_described(exc)}") from exc
