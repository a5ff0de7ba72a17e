"""``engine check``: load every environment and say, for each, whether it can score; ``engine score`` and
``engine serve`` check theirs the same way before they start (:func:`check_ready`).

What it checks of each kind, and when it hints at worker processes: docs/design.md, engine check and engine bench.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx

from engine._config import EngineConfig
from engine._core.contract import HintingVerifier, ProcessHint
from engine._core.scheduler import aborts_unlogged
from engine._engine import Engine
from engine._environments.digest import Pin, digest_directory, pin_verdict
from engine._environments.manifest import EXAMPLE_FIELD, Environment, load_environment
from engine._errors import DigestError, EngineError, Failure, ManifestError, UnreadyError, VerificationError
from engine._http.network import Proxies

__all__ = [
    "CONNECT_TIMEOUT",
    "EnvironmentCheck",
    "check_environment",
    "check_environments",
    "check_ready",
    "environment_dirs",
    "process_hint",
]

CONNECT_TIMEOUT = 5.0  # seconds to wait for an endpoint's host to accept a connection
# CPython's words when signal.signal() is called outside the main thread (signal.alarm-based timeouts do)
MAIN_THREAD_ONLY = "signal only works in main thread"
NOT_IMPORTED = "not imported (digest)"  # a plugin's verdict when its digest failed: the digest's column says why


@dataclass(frozen=True)
class EnvironmentCheck:
    """One environment's verdict: each column is "ok", a reason it failed, or "-" (not applicable)."""

    environment: str
    kind: str
    ref: str
    manifest: str
    digest: str
    verifier: str
    digest_now: str | None = None  # the directory's digest, when its pin is missing or stale
    hint: ProcessHint | None = None  # warm calls of its example measured processes would gain it cores
    error: VerificationError | None = None  # the failure its verifier column says, with where it happened

    @property
    def ok(self) -> bool:
        return all(value in ("ok", "-") for value in (self.manifest, self.digest, self.verifier))

    @property
    def problem(self) -> str:
        """Why it cannot score, in one line ("" if it can): its verifier and each column that failed."""
        failed = [f"{name}: {value}" for name, value in (("manifest", self.manifest), ("digest", self.digest),
                                                          ("verifier", self.verifier))
                  if value not in ("ok", "-", NOT_IMPORTED)]
        if not failed:
            return ""
        return "; ".join(failed if self.kind == "?" else [f"{self.kind} {self.ref!r}", *failed])


async def _reachable(url: str, proxies: Proxies) -> str:
    """ "ok" if the endpoint's host accepts a connection (or its proxy's, for a URL the environment proxies)."""
    proxy = proxies.proxy_for(httpx.URL(url))
    parts = urlsplit(proxy or url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    what = "the proxy " if proxy is not None else ""
    try:
        with anyio.fail_after(CONNECT_TIMEOUT):
            stream = await anyio.connect_tcp(parts.hostname or "", port)
    except TimeoutError:
        return f"no answer from {what}{parts.hostname}:{port} within {CONNECT_TIMEOUT:g} s"
    except OSError as exc:
        # anyio sums up every address it tried as "All connection attempts failed"; the cause says why
        cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
        return f"cannot connect to {what}{parts.hostname}:{port}: {cause.strerror or cause}"
    await stream.aclose()
    return "ok"


async def process_hint(engine: Engine, environment: str, items: Sequence[Mapping[str, Any]]) -> ProcessHint | None:
    """Whether environment ``environment``'s plugin would gain from ``"executor": "process"``, and how many cores it
    would use, from warm calls of ``items`` timed for it: the one decision ``engine check`` and ``engine bench`` share.

    The engine never picks the process executor by itself: it changes a plugin's isolation (no state
    shared between items, tasks that must pickle), so it is the manifest's to say; this says when to.
    Only a loaded thread-executor plugin is called (``ThreadExecutor.process_hint``: what it measures).

    Args:
        engine: The open engine whose verifier of ``environment`` is timed; it must have been loaded.
        environment: A plugin environment's name.
        items: Items of that environment (``task``, ``trajectory``, maybe ``id``) it has scored: the calls cycle
            through them.

    Returns:
        The hint, or None: no gain worth it, or not a thread plugin.

    Raises:
        VerificationError: A call failed (it names the item's ``id``, if it has one).
    """
    verifier = engine._verifier(environment)
    if not isinstance(verifier, HintingVerifier):
        return None
    try:
        return await verifier.process_hint(items)
    except Failure as exc:
        item_id = items[exc.position].get("id") if exc.position is not None else None
        named = f" (id {item_id!r})" if item_id is not None else ""
        raise VerificationError(
            verifier.kind,
            verifier.ref,
            f"an item it had scored{named} failed when called again (timing warm calls for the process hint): "
            f"{exc.reason}",
            key=verifier.key,
            environment=environment,
            item_id=item_id,
            timed_out=exc.timed_out,
            plugin_frames=exc.frames,
        ) from exc.__cause__


def _rubric_verdict(engine: Engine, ref: str) -> str:
    """Both things a rubric needs, each reported: the rubric itself, and a judge to grade with it."""
    problems = []
    try:
        engine.rubrics.resolve(ref)
    except EngineError as exc:
        problems.append(getattr(exc, "reason", str(exc)))
    if engine.config.judge is None:
        problems.append("no [judge] is configured to grade rubrics")
    return "; ".join(problems) or "ok"


def _needs_main_thread(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it came from, is CPython refusing a signal handler outside the main thread."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ValueError) and MAIN_THREAD_ONLY in str(current):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


async def _example_verdict(
    engine: Engine, env: Environment, *, hint: bool
) -> tuple[str, ProcessHint | None, VerificationError | None]:
    """ "ok" if the plugin scores its manifest's sample item, or has none; else why not, and what to do. With it,
    the process hint its warm calls give (:func:`process_hint`) if ``hint``, and the error it failed with.

    A plugin that sets a signal handler (``signal.alarm`` timeouts: math-verify's) imports fine and
    fails every call in the engine's threads: only a call shows it, so check makes one, as the
    engine would, in the executor the manifest names.
    """
    example: Any = env.manifest.get(EXAMPLE_FIELD)
    if example is None:
        return "ok", None, None
    if not isinstance(example, Mapping) or not {"task", "trajectory"} <= set(example):
        return f"manifest field '{EXAMPLE_FIELD}' must be an object with 'task' and 'trajectory'", None, None
    if not isinstance(example["task"], Mapping):  # the item would be the caller's TypeError, not a verdict
        return f"manifest field '{EXAMPLE_FIELD}': its 'task' must be an object", None, None
    item = {"environment": env.name, "task": example["task"], "trajectory": example["trajectory"]}
    try:
        with aborts_unlogged():  # its failure is this verdict, not a run's batch aborted
            await engine.score([item])
    except VerificationError as exc:
        if env.verifier.executor == "thread" and _needs_main_thread(exc):
            return (
                f"its {EXAMPLE_FIELD} fails in the engine's threads only: it sets a signal handler (signal.alarm "
                "timeouts, as math-verify's), which works only in a process's main thread; set \"executor\": "
                "\"process\" in its manifest's verifier"
            ), None, exc
        return f"its {EXAMPLE_FIELD} fails: {exc.reason}", None, exc
    if not hint:
        return "ok", None, None
    try:
        return "ok", await process_hint(engine, env.name, [item]), None
    except VerificationError as exc:  # it scored once, and not again: the plugin is not a function of its item
        return f"its {EXAMPLE_FIELD} fails: {exc.reason}", None, exc


def environment_dirs(root: Path) -> list[Path]:
    """The directories under ``root`` a check looks at, in name order: every one but hidden ones and ``__pycache__``'s.

    Raises:
        ManifestError: ``root`` is not a directory.
    """
    if not root.is_dir():
        raise ManifestError(f"{root}: the environments directory does not exist")
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))


async def check_environments(*, config: EngineConfig) -> list[EnvironmentCheck]:
    """Check every environment directory under ``config.environments``, in name order."""
    paths = environment_dirs(config.environments)
    proxies = Proxies.from_environment()  # as the engine reads them
    async with Engine(config) as engine:
        return [await check_environment(engine, path, proxies=proxies, hint=True) for path in paths]


async def check_ready(engine: Engine, paths: Iterable[Path], *, which: str, then: str) -> list[EnvironmentCheck]:
    """Check the environments at ``paths`` as ``engine check`` does, on the open ``engine`` a run is about to use.

    The imports are the engine's own (``Engine.load``): a plugin is imported once, for the run too. An endpoint
    is not contacted: one down for a moment at the start is its retries' to wait for, as at any other time.

    Args:
        engine: The engine the run scores with.
        paths: The environments' directories.
        which: Which environments they are, for the error ("the input names").
        then: What follows from a failure, for the error (", so no row was scored").

    Returns:
        Each one's check (each can score), in name order.

    Raises:
        UnreadyError: Some cannot score: each named, with why.
    """
    checks = [await check_environment(engine, path, proxies=None) for path in sorted(set(paths))]
    broken = [(check.environment, check.problem) for check in checks if not check.ok]
    if broken:
        raise UnreadyError(broken, checked=len(checks), which=which, then=then)
    return checks


async def check_environment(
    engine: Engine, path: Path, *, proxies: Proxies | None, hint: bool = False
) -> EnvironmentCheck:
    """Check environment directory ``path`` on the open ``engine``; ``proxies`` None: an endpoint is not contacted;
    ``hint``: time warm calls of its example for the process hint (``engine check``'s, not a run's check)."""
    config = engine.config
    try:
        env = load_environment(path)
    except ManifestError as exc:
        return EnvironmentCheck(path.name, "?", "?", str(exc), "-", "-")
    pin = config.pins.get(env.name)
    try:
        digest = digest_directory(path)
    except DigestError as exc:  # it holds a FIFO, a socket or a device: nothing in it is imported
        spec = env.verifier
        return EnvironmentCheck(env.name, spec.kind, spec.ref, "ok", exc.reason, NOT_IMPORTED)
    # a plugin needs a pin unless allow_unpinned; a pin of another kind is checked all the same
    pinned = pin_verdict(digest, pin, required=env.verifier.kind == "plugin" and not config.allow_unpinned)
    digest_status = {
        Pin.MATCHES: "ok",
        Pin.CHANGED: f"changed since pinned (now {digest})",
        Pin.MISSING: f'no pin; after vetting, pin it: {env.name} = "{digest}"',
        Pin.NOT_NEEDED: "-",
    }[pinned]
    verdict, process, error = "ok", None, None
    try:
        if env.verifier.kind == "plugin":
            if digest_status not in ("ok", "-"):
                verdict = NOT_IMPORTED
            else:
                await engine.load(env.name)
                verdict, process, error = await _example_verdict(engine, env, hint=hint)
        elif env.verifier.kind == "endpoint":
            verdict = await _reachable(env.verifier.ref, proxies) if proxies is not None else "-"
        else:
            verdict = _rubric_verdict(engine, env.verifier.ref)
    except EngineError as exc:
        verdict = getattr(exc, "reason", str(exc))
        error = exc if isinstance(exc, VerificationError) else None
    except ValueError as exc:  # a manifest the engine takes under a name it does not (not an environment's name)
        verdict = str(exc)
    stale = digest_status not in ("ok", "-")
    spec = env.verifier
    now = digest if stale else None
    return EnvironmentCheck(env.name, spec.kind, spec.ref, "ok", digest_status, verdict, now, process, error)
