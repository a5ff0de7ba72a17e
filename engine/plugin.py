"""Plugin verifiers: ``module:callable`` inside a digest-pinned environment directory.

The module is imported lazily, on the first item that needs it, once however many items ask at
the same time, and never before the directory's digest matches its pin. It is imported as a
submodule of a package private to this environment (``_engine_env_<n>_<name>``), so two
environments that both ship ``verify.py`` each get their own, and a plugin's sibling files are
reached with relative imports (``from . import helpers``).

Sync callables run in the engine's bounded thread pool, so they never block the event loop;
``async def`` callables are awaited on the loop. An overrun of the call timeout abandons the
thread (Python cannot kill it) and fails the item.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import inspect
import itertools
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import anyio.to_thread

from .config import Limits
from .digest import digest_directory
from .errors import VerificationError, describe
from .manifest import Environment
from .verifier import check_reward

__all__ = ["PluginVerifier"]

_package_numbers = itertools.count()


def _is_async(fn: Callable[..., Any]) -> bool:
    # an instance whose __call__ is "async def" is awaited too
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


class PluginVerifier:
    """One plugin environment's callable, imported on first use and cached for the engine's life."""

    kind = "plugin"

    def __init__(
        self,
        environment: Environment,
        limits: Limits,
        *,
        pin: str | None,
        allow_unpinned: bool,
        thread_limiter: anyio.CapacityLimiter,
    ) -> None:
        self.environment = environment
        self.ref = environment.verifier.ref
        self.key = environment.verifier_key
        self.limits = limits
        self._pin = pin
        self._allow_unpinned = allow_unpinned
        self._threads = thread_limiter
        self._fn: Callable[..., Any] | None = None
        self._is_async = False
        self._lock = anyio.Lock()
        self.digest: str | None = None  # the digest the module was imported at
        self.retries = 0  # plugins are never retried: a failure is the plugin's answer

    def provenance(self) -> Mapping[str, Any]:
        return {"kind": self.kind, "ref": self.ref, "environment": self.environment.name, "digest": self.digest}

    def _fail(self, reason: str) -> VerificationError:
        return VerificationError(self.kind, self.ref, reason, environment=self.environment.name)

    def _check_digest(self) -> str:
        env = self.environment
        digest = digest_directory(env.path)
        if self._pin is None:
            if not self._allow_unpinned:
                raise self._fail(
                    f"environment {env.name!r} has no pin and allow_unpinned is false; after vetting it, "
                    f'add under [pins]: {env.name} = "{digest}"'
                )
        elif digest != self._pin:
            raise self._fail(
                f"environment {env.name!r} changed since it was pinned: its digest is {digest}, "
                f"the pin is {self._pin}; nothing was imported"
            )
        return digest

    def _import(self) -> tuple[Callable[..., Any], str]:
        """Check the digest, then import the module and find the callable (runs in a thread)."""
        digest = self._check_digest()
        module_name, _, attr_path = self.ref.partition(":")
        safe = re.sub(r"\W", "_", self.environment.name)
        package = f"_engine_env_{next(_package_numbers)}_{safe}"
        spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
        pkg = importlib.util.module_from_spec(spec)
        pkg.__path__ = [str(self.environment.path)]
        sys.modules[package] = pkg
        try:
            target: Any = importlib.import_module(f"{package}.{module_name}")
        except (Exception, SystemExit) as exc:
            sys.modules.pop(package, None)
            raise self._fail(f"cannot import module {module_name!r}: {describe(exc)}") from exc
        for part in attr_path.split("."):
            try:
                target = getattr(target, part)
            except AttributeError:
                raise self._fail(f"module {module_name!r} has no attribute {attr_path!r}") from None
        if not callable(target):
            raise self._fail(f"{attr_path!r} in module {module_name!r} is a {type(target).__name__}, not callable")
        return target, digest

    async def load(self) -> Callable[..., Any]:
        """The callable, imported on the first call (after the digest check) and cached."""
        if self._fn is None:
            async with self._lock:
                if self._fn is None:
                    fn, digest = await anyio.to_thread.run_sync(self._import, abandon_on_cancel=True)
                    self._is_async, self.digest, self._fn = _is_async(fn), digest, fn
        return self._fn

    async def _call(self, fn: Callable[..., Any], task: Mapping[str, Any], trajectory: Any) -> Any:
        if self._is_async:
            return await fn(task, trajectory)
        return await anyio.to_thread.run_sync(
            functools.partial(fn, task, trajectory), abandon_on_cancel=True, limiter=self._threads
        )

    async def verify(self, task: Mapping[str, Any], trajectory: Any) -> float:
        fn = await self.load()
        try:
            with anyio.move_on_after(self.limits.timeout) as deadline:
                value = await self._call(fn, task, trajectory)
        except (Exception, SystemExit) as exc:  # a plugin's sys.exit() must not end the trainer
            raise self._fail(f"raised {describe(exc)}") from exc
        if deadline.cancelled_caught:
            raise self._fail(f"timed out after {self.limits.timeout:g} s")
        try:
            return check_reward(value)
        except (TypeError, ValueError) as exc:
            raise self._fail(str(exc)) from None
