"""``engine check``: load every environment and say, for each, whether it can score.

For every directory under the configured environments: the manifest is valid; the digest
matches its pin (required for plugins unless ``allow_unpinned``); a plugin imports and names a
callable; an endpoint's host (or the proxy the environment names for it) accepts a TCP
connection; a rubric resolves and a judge is configured.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

import anyio
import httpx

from engine._config import EngineConfig
from engine._engine import Engine
from engine._environments.digest import Pin, digest_directory, pin_verdict
from engine._environments.manifest import load_environment
from engine._errors import DigestError, EngineError, ManifestError
from engine._http.network import Proxies

__all__ = ["CONNECT_TIMEOUT", "EnvironmentCheck", "check_environments"]

CONNECT_TIMEOUT = 5.0  # seconds to wait for an endpoint's host to accept a connection


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

    @property
    def ok(self) -> bool:
        return all(value in ("ok", "-") for value in (self.manifest, self.digest, self.verifier))


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


async def check_environments(*, config: EngineConfig) -> list[EnvironmentCheck]:
    """Check every environment directory under ``config.environments``, in name order."""
    root = config.environments
    if not root.is_dir():
        raise ManifestError(f"{root}: the environments directory does not exist")
    checks = []
    proxies = Proxies.from_environment()  # as the engine reads them
    async with Engine(config) as engine:
        for path in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))):
            try:
                env = load_environment(path)
            except ManifestError as exc:
                checks.append(EnvironmentCheck(path.name, "?", "?", str(exc), "-", "-"))
                continue
            pin = config.pins.get(env.name)
            try:
                digest = digest_directory(path)
            except DigestError as exc:  # it holds a FIFO, a socket or a device: nothing in it is imported
                spec = env.verifier
                refused = "not imported (digest)"
                checks.append(EnvironmentCheck(env.name, spec.kind, spec.ref, "ok", exc.reason, refused))
                continue
            # a plugin needs a pin unless allow_unpinned; a pin of another kind is checked all the same
            pinned = pin_verdict(digest, pin, required=env.verifier.kind == "plugin" and not config.allow_unpinned)
            digest_status = {
                Pin.MATCHES: "ok",
                Pin.CHANGED: f"changed since pinned (now {digest})",
                Pin.MISSING: f'no pin; after vetting, pin it: {env.name} = "{digest}"',
                Pin.NOT_NEEDED: "-",
            }[pinned]
            verdict = "ok"
            try:
                if env.verifier.kind == "plugin":
                    if digest_status not in ("ok", "-"):
                        verdict = "not imported (digest)"
                    else:
                        await engine.load(env.name)
                elif env.verifier.kind == "endpoint":
                    verdict = await _reachable(env.verifier.ref, proxies)
                else:
                    verdict = _rubric_verdict(engine, env.verifier.ref)
            except EngineError as exc:
                verdict = getattr(exc, "reason", str(exc))
            stale = digest_status not in ("ok", "-")
            spec = env.verifier
            now = digest if stale else None
            checks.append(EnvironmentCheck(env.name, spec.kind, spec.ref, "ok", digest_status, verdict, now))
    return checks
