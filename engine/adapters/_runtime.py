"""What every adapter shares: where its engine is configured (a config file, or a running ``engine serve``), one
engine per event loop (closed with its loop, or at exit), a background loop for synchronous adapters, and
per-sample calls gathered into engine batches (docs/design.md, "Gathering")."""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import os
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import engine
from engine._core.batcher import Batcher
from engine._core.portal import LoopThread

__all__ = [
    "DEFAULT_MAX_BATCH",
    "DEFAULT_WINDOW",
    "ENV_CONFIG",
    "ENV_ENVIRONMENT",
    "ENV_TOKEN",
    "ENV_URL",
    "Coalescer",
    "Source",
    "close_engines",
    "coalescer",
    "engine_for",
    "environment_from",
    "in_background",
    "source_of",
]

ENV_CONFIG = "ENGINE_CONFIG"  # path of the engine's config file
ENV_URL = "ENGINE_URL"  # or the URL of an `engine serve`
ENV_TOKEN = "ENGINE_TOKEN"  # its token, if it asks for one
ENV_ENVIRONMENT = "ENGINE_ENVIRONMENT"  # the environment of items that do not name one
# Per-sample calls are gathered while each pass of the loop brings more, for at most this many seconds
# (a steady stream would otherwise never be flushed), and into batches of at most this many items.
DEFAULT_WINDOW = 0.005
DEFAULT_MAX_BATCH = 4096
CLOSE_TIMEOUT = 30.0  # seconds an engine gets to close at exit (its worker processes stop, its sockets close)

logger = logging.getLogger("engine")
T = TypeVar("T")


@dataclass(frozen=True)
class Source:
    """Where an adapter's engine comes from: a config (its file's absolute path, or the object), or a URL."""

    config: Path | engine.EngineConfig | None = None
    url: str | None = None
    token: str | None = field(default=None, repr=False)

    @classmethod
    def of(
        cls, config: str | os.PathLike[str] | engine.EngineConfig | None, url: str | None, token: str | None
    ) -> Source:
        """The source the arguments name, or else the environment variables'; ``ValueError`` if neither or both."""
        if config is None and url is None:
            return cls.from_environment()
        if config is not None and url is not None:
            raise ValueError("give the engine a config or a url, not both")
        if url is not None:
            if not isinstance(url, str) or not url:
                raise TypeError(f"url must be a non-empty string, got {url!r}")
            return cls(url=url, token=token)
        if token is not None:
            raise ValueError("token goes with url= (an engine serve's), not with a config")
        if isinstance(config, engine.EngineConfig):
            return cls(config=config)
        if not isinstance(config, str | os.PathLike):
            raise TypeError(f"config must be a path to the engine's config file or an EngineConfig, got {config!r}")
        return cls(config=Path(config).absolute())  # a later chdir, or another process's cwd, changes nothing

    @classmethod
    def from_environment(cls) -> Source:
        """The source ``ENGINE_CONFIG`` or ``ENGINE_URL`` (with ``ENGINE_TOKEN``) names."""
        config, url = os.environ.get(ENV_CONFIG) or None, os.environ.get(ENV_URL) or None
        if config is None and url is None:
            raise ValueError(f"no engine configured: pass config= or url=, or set {ENV_CONFIG} or {ENV_URL}")
        if config is not None and url is not None:
            raise ValueError(f"set {ENV_CONFIG} or {ENV_URL}, not both")
        if url is not None:
            return cls(url=url, token=os.environ.get(ENV_TOKEN) or None)
        return cls(config=Path(config).absolute())  # type: ignore[arg-type]  # not None here

    @property
    def key(self) -> tuple[Any, ...]:
        """What one engine per loop is kept for: the same file, object or server is the same engine."""
        if isinstance(self.config, engine.EngineConfig):
            return ("object", id(self.config))  # the engine kept for it keeps the object, and its id, alive
        return ("config", self.config) if self.config is not None else ("url", self.url, self.token)


_SOURCES: dict[tuple[str | None, ...], Source] = {}


def source_of(config: str | None, url: str | None, token: str | None) -> Source:
    """``Source.of`` for a per-sample caller: kept per arguments and variables (a relative path is resolved
    against the directory of the first call that names it)."""
    if config is None and url is None:  # the variables' (read at each call: a test or a launcher may change them)
        env = os.environ
        key: tuple[str | None, ...] = (None, None, token, env.get(ENV_CONFIG), env.get(ENV_URL), env.get(ENV_TOKEN))
    else:
        key = (config, url, token)
    found = _SOURCES.get(key)
    if found is None:
        if len(_SOURCES) >= 64:
            _SOURCES.clear()
        found = _SOURCES[key] = Source.of(config, url, token)
    return found


def environment_from(explicit: str | None, what: str) -> str:
    """``explicit``, else ``ENGINE_ENVIRONMENT``; ``ValueError`` saying where ``what`` could have named one."""
    name = explicit or os.environ.get(ENV_ENVIRONMENT) or None
    if name is None:
        raise ValueError(f"no environment for this item: {what}, or set {ENV_ENVIRONMENT}")
    return name


async def _open(source: Source) -> Any:
    """The engine ``source`` names, opened on the running loop."""
    if source.url is not None:
        eng: Any = engine.Engine.connect(source.url, token=source.token)
    else:
        config = source.config
        eng = engine.Engine(config if isinstance(config, engine.EngineConfig) else engine.load_config(str(config)))
    await eng.__aenter__()
    return eng


class _LoopEngines:
    """The engines and coalescers of one event loop, closed together.

    An engine is opened on the event loop that first needs it, once per loop and source (concurrent first
    calls share the opening), and closed:

    * when that loop shuts down its async generators (``asyncio.run`` and ``asyncio.Runner`` do, as they
      close it): each loop's engines are held by an async generator (``keeper``), which asyncio closes then;
    * else at exit (:func:`close_engines`, a plain ``atexit`` hook registered once the engine's own modules
      are imported, so that it runs before theirs): a loop still running in another thread (TRL's
      daemon-thread loop, or the adapters' own) closes them there, a loop that is stopped but not closed
      runs their closing itself, a closed loop's are left to the process's end.

    A forked child forgets its parent's loops and engines and opens its own.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = weakref.ref(loop)
        self.opening: dict[tuple[Any, ...], asyncio.Task[Any]] = {}
        self.coalescers: dict[tuple[Any, ...], Coalescer] = {}
        self.keeper: Any = None  # the async generator asyncio closes at the loop's shutdown
        self.closed = False

    async def engine(self, source: Source) -> Any:
        key = source.key
        task = self.opening.get(key)
        if task is None:
            if self.closed:
                raise RuntimeError("the adapters' engines of this event loop are closed")
            loop = asyncio.get_running_loop()
            task = self.opening[key] = loop.create_task(_open(source))
            task.add_done_callback(functools.partial(self._opened, key))
            if self.keeper is None:
                self.keeper = _keeper(self)
                await self.keeper.__anext__()  # started on this loop: asyncio now tracks it, to close it
        return await asyncio.shield(task)  # a caller cancelled does not cancel the opening others wait for

    def _opened(self, key: tuple[Any, ...], task: asyncio.Task[Any]) -> None:
        failed = task.cancelled() or task.exception() is not None
        if failed and self.opening.get(key) is task:  # the next call tries again
            del self.opening[key]

    async def aclose(self) -> None:
        self.closed = True
        tasks, self.opening = list(self.opening.values()), {}
        for coalescer in self.coalescers.values():
            await coalescer.drain()
        for task in tasks:
            try:
                eng = await task
            except BaseException:  # it never opened: nothing to close
                continue
            try:
                await eng.__aexit__(None, None, None)
            except Exception:
                logger.warning("an adapter's engine failed to close", exc_info=True)
        loop = self.loop()
        if loop is not None:
            _forget(loop, self)

    async def shut(self) -> None:
        """Close them through the keeper, so that asyncio has nothing left to close."""
        if self.keeper is not None:
            await self.keeper.aclose()
        else:
            await self.aclose()


async def _keeper(entry: _LoopEngines) -> AsyncIterator[None]:
    try:
        yield
    finally:
        if not entry.closed:
            await entry.aclose()


_LOCK = threading.Lock()
_ENTRIES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopEngines] = weakref.WeakKeyDictionary()
_PORTAL: LoopThread | None = None
_PID = os.getpid()
_EXIT_REGISTERED = False
_INHERITED: list[Any] = []  # what a forked child's parent had opened
_LAST: tuple[asyncio.AbstractEventLoop, Source, _LoopEngines, Coalescer] | None = None  # coalescer()'s last answer


def _this_process() -> None:
    """Forget what a parent process opened (under ``_LOCK``): its loops do not run in a forked child."""
    global _PID, _PORTAL, _ENTRIES, _LAST
    if os.getpid() != _PID:
        # kept, never collected: nothing of theirs runs here (the exit hook is inherited: atexit's are)
        _INHERITED.append((_PORTAL, _ENTRIES))
        _PID, _PORTAL, _ENTRIES, _LAST = os.getpid(), None, weakref.WeakKeyDictionary(), None


def _register_exit() -> None:
    """Close every engine at exit (under ``_LOCK``).

    ``atexit`` runs the hooks registered last first, and the engine's modules register theirs as they
    are imported (the plugin workers' pool kills the workers still running): they are imported first,
    so that the engines close their workers before that hook kills them.
    """
    global _EXIT_REGISTERED
    if not _EXIT_REGISTERED:
        getattr(engine, "Engine")  # noqa: B009  # the public face imports the engine's modules lazily
        atexit.register(close_engines)
        _EXIT_REGISTERED = True


def _forget(loop: asyncio.AbstractEventLoop, entry: _LoopEngines) -> None:
    """Drop a closed entry: its keeper refers to its loop, which would otherwise be kept for ever (a trainer
    that runs ``asyncio.run`` per step makes a loop per step)."""
    global _LAST
    with _LOCK:
        if _ENTRIES.get(loop) is entry:
            del _ENTRIES[loop]
        if _LAST is not None and _LAST[0] is loop:
            _LAST = None


def _entry(loop: asyncio.AbstractEventLoop) -> _LoopEngines:
    with _LOCK:
        _this_process()
        entry = _ENTRIES.get(loop)
        if entry is None or entry.closed:
            entry = _ENTRIES[loop] = _LoopEngines(loop)
            _register_exit()
        return entry


async def engine_for(source: Source) -> Any:
    """The engine ``source`` names on the running loop, opened on first use."""
    return await _entry(asyncio.get_running_loop()).engine(source)


def coalescer(source: Source) -> Coalescer:
    """The running loop's :class:`Coalescer` of ``source``'s engine."""
    global _LAST
    loop = asyncio.get_running_loop()
    last = _LAST
    if last is not None and last[0] is loop and last[1] is source and not last[2].closed:
        return last[3]  # the same caller again: a per-sample call pays no lock nor lookup
    entry = _entry(loop)
    found = entry.coalescers.get(source.key)
    if found is None:
        found = entry.coalescers[source.key] = Coalescer(entry, source)
    _LAST = (loop, source, entry, found)
    return found


def in_background(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``await fn(*args)`` on the process's background loop, from synchronous code, blocking until done.

    The loop (a :class:`~engine._core.portal.LoopThread`, the blocking face's too) is started on first use,
    in a daemon thread, which still runs when ``atexit`` hooks run, so :func:`close_engines` can close its
    engines there.
    """
    global _PORTAL
    with _LOCK:
        _this_process()
        if _PORTAL is None:
            _register_exit()
            _PORTAL = LoopThread("engine-adapters-loop")
        portal = _PORTAL.portal
    return portal.call(fn, *args)


def _close(loop: asyncio.AbstractEventLoop, entry: _LoopEngines) -> None:
    if entry.closed or loop.is_closed():  # a closed loop can run nothing: the process's end releases them
        return
    try:
        if loop.is_running():
            asyncio.run_coroutine_threadsafe(entry.shut(), loop).result(CLOSE_TIMEOUT)
        else:
            loop.run_until_complete(entry.shut())
    except Exception:
        logger.warning("the adapters' engines of an event loop failed to close", exc_info=True)


def close_engines() -> None:
    """Close every engine the adapters opened in this process, and their background loop; run at exit.

    Call it from synchronous code (not from a coroutine on a loop whose engines it would close). The
    next adapter call opens a new engine.
    """
    global _PORTAL, _LAST
    with _LOCK:
        _this_process()
        entries, portal = list(_ENTRIES.items()), _PORTAL
        _ENTRIES.clear()
        _PORTAL = _LAST = None
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    for loop, entry in entries:
        if loop is running:
            raise RuntimeError("close_engines() is called from synchronous code, not from the loop it would close")
        _close(loop, entry)
    if portal is not None:
        portal.stop(timeout=CLOSE_TIMEOUT)  # the calls under way finish first


@dataclass(eq=False)
class _Call:
    """One caller's items (one sample, or a group), where they start in the gathered batch, and its answer."""

    items: Sequence[Mapping[str, Any]]
    future: asyncio.Future[list[float]]
    start: int = 0
    gathered: int = 0  # the calls of the failed batch it was scored again after, alone (0: it never was)


class Coalescer:
    """Per-sample calls on one loop gathered into engine batches (verl's, slime's, OpenRLHF's calls).

    A call's items wait in the window (``engine._core.batcher``) for at most ``DEFAULT_WINDOW`` seconds, in
    batches of at most ``DEFAULT_MAX_BATCH`` items. Each call gets exactly what it would get alone, as
    ``engine serve``'s gatherer gives each request: its own rewards, or its own error naming its own sample
    (how: docs/design.md, "Gathering").
    """

    def __init__(self, entry: _LoopEngines, source: Source) -> None:
        self._entry = entry
        self._source = source
        self._window = Batcher(self._start_batch, window=DEFAULT_WINDOW, most=DEFAULT_MAX_BATCH)
        self._running: set[asyncio.Task[None]] = set()
        self.batches = 0  # engine batches scored or failed so far (tests and benchmarks read it)

    def submit(self, items: Sequence[Mapping[str, Any]]) -> asyncio.Future[list[float]]:
        """A future of the rewards of ``items`` (one call's), scored in the next batch (call from the entry's loop)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[float]] = loop.create_future()
        if not items:
            future.set_result([])
            return future
        items = tuple(items)  # the caller's list may change while it waits: its rewards are these items'
        self._window.add(_Call(items, future), len(items))
        return future

    async def score(self, item: Mapping[str, Any]) -> float:
        """The reward of one item, scored with the loop's other concurrent calls."""
        return (await self.submit((item,)))[0]

    async def score_many(self, items: Sequence[Mapping[str, Any]]) -> list[float]:
        """The rewards of one call's items (a group), in order, scored with the loop's other concurrent calls."""
        return await self.submit(items)

    def _start_batch(self, calls: list[_Call]) -> None:
        self._start(self._score(calls))

    def _start(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def drain(self) -> None:
        """Wait for the batches under way (before the engine closes)."""
        self._window.flush()
        while self._running:  # a failed batch starts its calls again, alone
            await asyncio.wait(list(self._running))

    async def _score(self, calls: list[_Call], eng: Any = None) -> None:
        """Score ``calls`` as one batch (on ``eng``, the engine a failed batch ran on, when they are scored again)."""
        try:
            await self._answer(calls, eng)
        except BaseException as exc:  # a bug, or cancelled: no caller is left waiting for ever
            for call in calls:
                if isinstance(exc, Exception):
                    _fail(call, exc)
                elif not call.future.done():
                    call.future.cancel()
            raise

    async def _answer(self, calls: list[_Call], eng: Any) -> None:
        items: list[Mapping[str, Any]] = []
        for call in calls:
            call.start = len(items)
            items += call.items
        try:
            if eng is None:
                eng = await self._entry.engine(self._source)
            rewards = await eng.score(items)
            if len(rewards) != len(items):  # never pair rewards with the wrong calls
                raise RuntimeError(f"the engine returned {len(rewards)} rewards for {len(items)} items")
        except engine.VerificationError as exc:
            self._split_failure(calls, exc, len(items), eng)
            return
        except (ValueError, TypeError) as exc:  # misuse, naming no call: each learns its own, alone
            if len(calls) == 1 or eng is None:
                for call in calls:
                    _fail(call, exc)
            else:
                self._alone(calls, eng, len(calls))
            return
        except Exception as exc:  # no answer at all (a service gone, refused): every call's, as it is
            for call in calls:
                _fail(call, exc)
            return
        finally:
            self.batches += 1
        for call in calls:
            if not call.future.done():  # its caller may have been cancelled
                call.future.set_result(list(rewards[call.start : call.start + len(call.items)]))

    def _split_failure(self, calls: list[_Call], exc: engine.VerificationError, size: int, eng: Any) -> None:
        """The failing item's call gets the error, naming its own sample; the others are scored alone.

        A plugin's failure is checked alone too: a chunk of its items in one thread may hold several calls'
        items, and its timeout is then not the named item's alone.
        """
        place = exc.index
        if len(calls) == 1:
            call = calls[0]
            if type(place) is int and exc.environment is not None and 0 <= place < size:
                own = exc.at_item(exc.environment, place, exc.item_id)
                own.__cause__ = exc.__cause__
                exc = own
                if call.gathered:
                    exc.add_note(
                        f"{call.gathered} calls were gathered into one engine batch, which failed; scored again "
                        f"alone, this call failed on its own sample {place}"
                    )
            _fail(call, exc)
            return
        if type(place) is not int or exc.environment is None or not 0 <= place < size or exc.kind == "plugin":
            self._alone(calls, eng, len(calls))  # the error names no item of the batch, or may not be its item's alone
            return
        owner = next(call for call in reversed(calls) if call.start <= place)
        own = exc.at_item(exc.environment, place - owner.start, exc.item_id)
        own.__cause__ = exc.__cause__
        own.add_note(
            f"{len(calls)} calls were gathered into one engine batch of {size} items; the failing item is "
            f"this call's own sample {place - owner.start}, and the other calls were scored again without it"
        )
        _fail(owner, own)
        self._alone([call for call in calls if call is not owner], eng, len(calls))

    def _alone(self, calls: list[_Call], eng: Any, gathered: int) -> None:
        """Each call scored as a batch of its own, as if it had never been gathered, on the same engine (which
        the loop's closing keeps open until they are done)."""
        for call in calls:
            if not call.future.done():
                call.gathered = gathered
                self._start(self._score([call], eng))


def _fail(call: _Call, exc: BaseException) -> None:
    if not call.future.done():
        call.future.set_exception(exc)
