"""Plugin verifiers: ``module:callable`` inside a digest-pinned environment directory, imported once.

:class:`PluginVerifier` vets the directory's digest, imports the module once (or has worker processes
import it), picks one executor for its calls, and makes every failure of theirs the ``Failure`` the
scheduler sees. The design is in docs/design.md, "Plugin executors".
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio

from engine._config import Limits
from engine._core import meters
from engine._core.contract import ProcessHint, is_async
from engine._core.threads import in_thread, wait_future
from engine._environments.digest import MANIFEST, Pin, Snapshot, pin_verdict, snapshot_directory
from engine._environments.manifest import Environment
from engine._errors import DigestError, Failure
from engine._verifiers.plugin.executor import CallFailed, Executor
from engine._verifiers.plugin.frames import own_frames, where
from engine._verifiers.plugin.importer import PluginLoadError, forget, load_plugin
from engine._verifiers.plugin.in_processes import ProcessExecutor
from engine._verifiers.plugin.in_threads import ThreadExecutor
from engine._verifiers.plugin.launcher import default_workers
from engine._verifiers.plugin.on_loop import LoopExecutor
from engine._verifiers.plugin.wire import PluginSpec
from engine._verifiers.plugin.worker_client import PluginError

__all__ = ["PluginVerifier"]

_Imported = tuple[Callable[..., Any] | None, Snapshot]  # the callable (None: worker processes import it)


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
        self._root = os.path.abspath(environment.path)  # what a worker is told too: its frames name files under it
        self.ref = environment.verifier.ref
        self.key = environment.verifier_key
        self.limits = limits
        spec = environment.verifier
        # the process executor's workers import the module themselves: the engine only vets the directory
        self._workers = (spec.workers or default_workers()) if spec.executor == "process" else None
        self._loading = "importing the module" if self._workers is None else "checking the environment's digest"
        self._pin = pin
        self._allow_unpinned = allow_unpinned
        self._thread_limiter = thread_limiter
        self._executor: Executor | None = None  # chosen once the digest is vetted (and the module imported)
        self._closed = False
        self._import_future: concurrent.futures.Future[_Imported] | None = None
        self._imported: list[Snapshot] = []  # every snapshot an import was tried from: forgotten at close
        self.digest: str | None = None  # the digest the module was imported (or vetted) at
        self.retries = 0  # plugins are never retried: a failure is the plugin's answer

    def provenance(self) -> Mapping[str, Any]:
        return {"kind": self.kind, "ref": self.ref, "environment": self.environment.name, "digest": self.digest}

    def spent(self) -> Mapping[str, int]:
        return {}  # a plugin's calls cost only time, which the scheduler measures

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of its worker processes (process executor; none before the first call)."""
        return self._executor.worker_pids if self._executor is not None else []

    def _failure(self, fault: CallFailed) -> Failure:
        """The ``Failure`` the scheduler sees for ``fault``: every failure of a plugin is made here.

        What the plugin raised, if anything, gives its own frames (found here in a thread's or the loop's
        exception, carried by a worker's), and its reason ends with the innermost: a trainer's log then
        names the plugin's file and line under any executor.
        """
        cause, root = fault.__cause__, self._root
        if isinstance(cause, PluginError):
            frames = cause.frames
        else:
            frames = own_frames(cause, root) if cause is not None else ()
        reason = f"{fault.reason} (at {where(frames[-1], root)})" if frames else fault.reason
        return Failure(
            reason,
            position=fault.position,
            timed_out=fault.timed_out,
            of_environment=fault.of_environment,
            frames=frames,
        )

    def _check_digest(self) -> Snapshot:
        """The environment's snapshot, once its digest matches the pin: what is imported, and only that.

        The manifest the digest hashed must be the one the verifier was configured from (the
        environment's, read earlier): else a manifest swapped in between would pick a callable, an
        executor or a worker count nobody vetted, under a digest that matches the pin.
        """
        env = self.environment
        try:
            snapshot = snapshot_directory(env.path)
        except DigestError as exc:
            reason = f"environment {env.name!r} cannot be vetted: {exc.reason}; nothing was imported"
            raise CallFailed(reason, of_environment=True) from None
        if snapshot.manifest != env.manifest_bytes:  # the verifier would be one the digest did not cover
            raise CallFailed(
                f"environment {env.name!r}: {MANIFEST} changed after it was read; nothing was imported (the verifier "
                "is configured from the manifest the engine read, so it must be the manifest hashed; a new engine "
                "reads it again)",
                of_environment=True,
            )
        digest = snapshot.digest
        verdict = pin_verdict(digest, self._pin, required=not self._allow_unpinned)
        if verdict is Pin.MISSING:
            raise CallFailed(
                f"environment {env.name!r} has no pin and allow_unpinned is false; after vetting it, "
                f'add under [pins]: {env.name} = "{digest}"',
                of_environment=True,
            )
        if verdict is Pin.CHANGED:
            raise CallFailed(
                f"environment {env.name!r} changed since it was pinned: its digest is {digest}, "
                f"the pin is {self._pin}; nothing was imported",
                of_environment=True,
            )
        return snapshot

    def _import(self) -> _Imported:
        """Check the digest, then import the module from the snapshot checked and find the callable
        (runs in its own thread). A process-executor plugin is imported by each worker, not here."""
        snapshot = self._check_digest()
        if self._workers is not None:
            return None, snapshot
        self._imported.append(snapshot)
        try:
            return load_plugin(snapshot, self.environment.name, self.ref), snapshot
        except PluginLoadError as exc:
            raise CallFailed(exc.reason, of_environment=True) from exc.__cause__

    def _executor_for(self, fn: Callable[..., Any] | None, snapshot: Snapshot) -> Executor:
        """The one executor of its calls: in worker processes, on the event loop (``async def``), or in threads."""
        env = self.environment
        if fn is None:
            assert self._workers is not None  # the process executor's: its workers import the module
            spec = PluginSpec(self._root, env.name, self.ref, snapshot.digest)
            return ProcessExecutor(spec, snapshot.sources, self.limits, self._workers)
        if is_async(fn):
            return LoopExecutor(fn, self.limits.timeout)
        return ThreadExecutor(fn, env.name, self.limits, self._thread_limiter)

    async def _loaded(self) -> Executor:
        """Its executor, once the digest is vetted and the module imported (once).

        The import runs in a thread of its own whose result outlives the caller: every caller,
        in this batch or the next, waits for the same import, and an abort while it runs does
        not make the next batch import the module a second time. A failed import is tried
        again by the next caller (the file may have been fixed, and re-vetted).
        """
        if self._closed:
            raise RuntimeError("this plugin's engine is closed")
        if self._executor is not None:
            return self._executor
        # the digest check and the import, from the thread's start: start-up, not verifying (nor this call's latency)
        with meters.starting():
            future = self._import_future
            if future is None:
                future = self._import_future = in_thread(self._import, f"engine-import-{self.environment.name}")
            try:
                fn, snapshot = await wait_future(future)
            except Exception:
                if self._import_future is future:
                    self._import_future = None
                raise
        if self._executor is None:  # the first of the callers that waited for it
            self._executor = self._executor_for(fn, snapshot)
            self.digest = snapshot.digest
        return self._executor

    async def _loaded_by(self, deadline: float) -> Executor:
        """:meth:`_loaded`, by ``deadline``: the first call's timeout covers the import too."""
        with anyio.CancelScope(deadline=deadline):
            return await self._loaded()
        reason = f"timed out after {self.limits.timeout:g} s {self._loading}"
        raise CallFailed(reason, timed_out=True, of_environment=True)

    async def load(self) -> None:
        """Make the plugin ready to call, or raise ``Failure`` saying why it cannot be.

        Thread executor: the module is imported. Process executor: a worker process runs and has
        imported it.
        """
        try:
            executor = await self._loaded()
            await executor.warm()
        except CallFailed as fault:
            raise self._failure(fault) from fault.__cause__

    async def aclose(self) -> None:
        """Stop its worker processes or let its threads go (a call still running in one ends on its own),
        and forget its imported module, so an engine's plugin does not outlive it (a trainer may open many).

        A call still running in an abandoned thread keeps the module objects it uses; only the import
        system's entries go (a sibling module it imports lazily from then on is not found). An import
        still running is forgotten when it ends.
        """
        self._closed = True
        future = self._import_future
        if future is not None and not future.done():
            future.add_done_callback(lambda _: self._forget())
        self._forget()
        executor, self._executor = self._executor, None
        if executor is not None:
            await executor.aclose()

    def _forget(self) -> None:
        """Unregister the private packages its imports made (``engine._verifiers.plugin.importer.forget``)."""
        for snapshot in self._imported:
            forget(snapshot)

    @property
    def chunker(self) -> PluginVerifier:
        """What scores its items several to a call (``engine._core.contract.Chunker``): itself, under any executor."""
        return self

    def chunk_size(self, share: int) -> int:
        """Items per call, as its executor sizes them: one until its calls are measured."""
        return self._executor.chunk_size(share) if self._executor is not None else 1

    async def process_hint(self, items: Sequence[Mapping[str, Any]]) -> ProcessHint | None:
        """A hint that worker processes would gain it cores, if warm calls of ``items`` say so; else None.

        Only a loaded thread-executor plugin is called (``ThreadExecutor.process_hint``); raises ``Failure``
        if a call fails, its ``position`` the item's in ``items``.
        """
        if self._executor is None:
            return None
        try:
            return await self._executor.process_hint(items)
        except CallFailed as fault:
            raise self._failure(fault) from fault.__cause__

    async def verify(self, task: Mapping[str, Any], trajectory: Any) -> float:
        deadline = anyio.current_time() + self.limits.timeout
        try:
            executor = self._executor or await self._loaded_by(deadline)
            return await executor.call(task, trajectory, deadline)
        except CallFailed as fault:
            raise self._failure(fault) from fault.__cause__

    async def verify_chunk(self, items: Sequence[Mapping[str, Any]]) -> list[float]:
        try:
            executor = self._executor or await self._loaded_by(anyio.current_time() + self.limits.timeout)
            return await executor.call_chunk(items)
        except CallFailed as fault:
            raise self._failure(fault) from fault.__cause__
