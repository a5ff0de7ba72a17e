"""The registry: each environment's verifier and meter, built once and kept while the engine is open."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from engine._cache.store import VerdictStore
from engine._config import EngineConfig
from engine._core.contract import ENV_NAME, Verifier
from engine._core.meters import Meter
from engine._core.scheduler import Resolve
from engine._environments.manifest import Environment, load_environment
from engine._errors import ConfigError, ManifestError, VerificationError
from engine._http.network import Routes
from engine._http.retry import Sleep
from engine._keys import closest
from engine._verifiers.endpoint.verifier import EndpointVerifier
from engine._verifiers.plugin.verifier import PluginVerifier
from engine._verifiers.rubric.judge import Judge
from engine._verifiers.rubric.registry import RubricRegistry
from engine._verifiers.rubric.verdicts import InFlight
from engine._verifiers.rubric.verifier import RubricVerifier

__all__ = ["Registry", "Shared"]

logger = logging.getLogger("engine")


@dataclass(frozen=True)
class Shared:
    """What an open engine lends its verifiers: the routes to every URL, the threads of sync plugins, the judge
    and the verdict cache."""

    routes: Routes
    threads: anyio.CapacityLimiter
    judge: Judge | None
    cache: VerdictStore | None = None
    in_flight: InFlight = field(default_factory=InFlight)  # the judge's calls in flight, for every batch's dedup


class Registry:
    """Environment name -> environment -> verifier and meter, each built once; ``sleep`` is what retries wait with.

    An environment's name resolves to its :class:`~engine._environments.manifest.Environment` (its
    manifest, read once for the engine's life), then to its verifier. Plugins and endpoints are built
    once and live as long as the engine is open (imports and connections are reused); a rubric is
    resolved anew for each batch (:meth:`resolver`), so every item of a batch is judged against the
    same version even if a new one appears while it runs. A verifier's limits are one
    :class:`~engine._core.meters.Meter`, kept by its key, shared by every batch the engine scores. A
    ``refs`` key that names no verifier, or a ``pins`` entry no environment, is a ``ConfigError`` when the
    engine opens (:meth:`check_names`), naming the closest that does: a typo never passes in silence.
    """

    def __init__(self, config: EngineConfig, *, sleep: Sleep) -> None:
        self.config = config
        self.rubrics = RubricRegistry(config.rubrics)
        self._sleep = sleep
        self._shared: Shared | None = None
        self._environments: dict[str, Environment] = {}
        self._verifiers: dict[str, Verifier] = {}
        self._meters: dict[str, Meter] = {}

    def open(self, shared: Shared) -> None:
        """Build verifiers from now on with ``shared`` (the engine has just opened it)."""
        self._shared = shared

    async def aclose(self) -> None:
        """Close every verifier built (plugins with worker processes stop them); build none until opened again."""
        self._shared = None
        verifiers = list(self._verifiers.values())
        self._verifiers.clear()
        for verifier in verifiers:
            await verifier.aclose()

    def check_names(self) -> None:
        """``ConfigError`` if a ``pins`` entry names no environment, or a ``refs`` key no verifier of one, under
        ``environments``; it names every such entry and key, each with the closest name that does.

        A pin must name an environment's directory (one the engine would take; its manifest is not read for
        it): a pin of an environment that is not there would pin nothing, in silence.

        Each key must be one the engine would look its limits up by (``Environment.verifier_key``):
        a plugin's ``<env>/<module>:<callable>``, an endpoint's URL as its manifest writes it, a
        rubric's ``owner/name``. Every manifest is read for it (only when there are refs), and kept:
        it is the manifest the engine uses for the environment's life, as if a batch had read it.
        Measured: ~50 ms for 1,000 environments (none without refs). A manifest that cannot be read does not fail the
        open (its environment fails when used, as before, and ``engine check`` reports it): a plugin
        key naming that environment is let through with a warning, since it cannot be checked; any
        other key that matches nothing is still an error, which names the unreadable manifests.
        """
        root = self.config.environments
        directories = _environment_dirs(root)
        names = {path.name for path in directories}
        problems = [_unknown_pin(name, names, root) for name in self.config.pins if name not in names]
        problems += self._ref_problems(directories)
        if problems:
            raise ConfigError("; ".join(problems), source=self.config.source)

    def _ref_problems(self, directories: list[Path]) -> list[str]:
        """What is wrong with each ``refs`` key that names no verifier of the environments in ``directories``."""
        refs = self.config.refs
        if not refs:
            return []
        root = self.config.environments
        keys: set[str] = set()
        unreadable: list[str] = []
        for path in directories:
            env = self._environments.get(path.name)
            if env is None:
                try:
                    env = self._environments[path.name] = load_environment(path)
                except ManifestError:
                    unreadable.append(path.name)
                    continue
            keys.add(env.verifier_key)
        problems = []
        for key in refs:
            if key in keys:
                continue
            if ":" in key and not key[:8].lower().startswith(("http://", "https://")):
                environment = key.partition("/")[0]
                if environment in unreadable:
                    logger.warning("refs key %r: environment %r has a manifest that cannot be read", key, environment)
                    continue
            problems.append(_unknown_ref(key, keys, root, unreadable))
        return problems

    def environment(self, name: str) -> Environment:
        """The environment called ``name``, loaded once; ``ValueError`` if there is none."""
        env = self._environments.get(name)
        if env is None:
            if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an environment's directory name")
            name = str(name)  # a str subclass (numpy's np.str_, from verl) named and kept as the str it is
            path = self.config.environments / name
            if not path.is_dir():
                raise ValueError(f"unknown environment {name!r}: no directory {path}")
            env = self._environments[name] = load_environment(path)
        return env

    def verifier_for(self, env: Environment, rubrics: dict[str, Verifier] | None = None) -> Verifier:
        """The verifier of ``env``: a plugin's or endpoint's built once, a rubric's once per ``rubrics``.

        ``rubrics`` holds a batch's resolutions of its rubrics. Raises ``VerificationError`` when a
        rubric cannot be resolved or graded.
        """
        if rubrics is None:
            rubrics = {}
        shared = self._shared
        if shared is None:
            raise RuntimeError("the engine is not open: use 'async with Engine(...) as eng'")
        spec = env.verifier
        if spec.kind == "rubric":
            verifier = rubrics.get(spec.ref)
            if verifier is None:
                if shared.judge is None:
                    raise VerificationError("rubric", spec.ref, "no [judge] is configured to grade rubrics",
                                            key=env.verifier_key, cannot_load=True)
                verifier = rubrics[spec.ref] = RubricVerifier(
                    self.rubrics.resolve(spec.ref), shared.judge, shared.cache, shared.in_flight
                )
            return verifier
        key = env.verifier_key
        verifier = self._verifiers.get(key)
        if verifier is None:
            limits = self.config.limits_for(key)
            if spec.kind == "plugin":
                verifier = PluginVerifier(
                    env,
                    limits,
                    pin=self.config.pins.get(env.name),
                    allow_unpinned=self.config.allow_unpinned,
                    thread_limiter=shared.threads,
                )
            else:
                window = self.meter(key, adaptive=True).window
                verifier = EndpointVerifier(
                    spec.ref, limits, shared.routes.transport_for(spec.ref), sleep=self._sleep, window=window
                )
            self._verifiers[key] = verifier
        return verifier

    def meter(self, key: str, *, adaptive: bool = False) -> Meter:
        """The live limits of the verifier configured under ``key``, shared by every batch; ``adaptive``: its
        slots a window that adapts to a quota (an endpoint's, built with its verifier, before any batch asks)."""
        meter = self._meters.get(key)
        if meter is None:
            limits = self.config.limits_for(key)
            meter = self._meters[key] = Meter.adaptive(limits, self._sleep) if adaptive else Meter.from_limits(limits)
        return meter

    def resolver(self) -> Resolve:
        """What resolves one batch's environments: each rubric once, so all its items are judged alike."""
        rubrics: dict[str, Verifier] = {}

        def resolve(name: str) -> tuple[Verifier, Meter]:
            env = self.environment(name)
            verifier = self.verifier_for(env, rubrics)
            meter = self.meter(verifier.key)
            judge = self._shared.judge if self._shared is not None else None
            if env.verifier.kind == "rubric" and judge is not None:  # its calls queue inside for the judge's window
                meter = meter.through(judge.window)
            return verifier, meter

        return resolve


def _environment_dirs(root: Path) -> list[Path]:
    """The directories under ``root`` the engine would take for environments (a name it accepts); none if ``root``
    is no directory. (``engine check`` lists more: every directory, to say what is wrong with each.)"""
    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and ENV_NAME.fullmatch(p.name) and p.name[:2] != "__")
    except OSError:  # no such directory, or not one: no verifier, so every key is unknown
        return []


RUBRIC_VERSION = re.compile(r"(?P<name>[^/@:]+/[^/@:]+)@[0-9]+")  # owner/name@N: a rubric pinned to a version


def _unknown_ref(key: str, keys: set[str], root: Path, unreadable: list[str]) -> str:
    """Why ``key`` is refused, with the closest key that names a verifier."""
    message = f"refs.{key!r}: names no verifier of an environment under {root}"
    pinned = RUBRIC_VERSION.fullmatch(key)
    near = closest(key, keys, cutoff=0.0)
    if pinned is not None and pinned["name"] in keys:  # one rubric's limits hold for every version of it
        message += f" (a rubric's limits are keyed without its version, for every version: {pinned['name']!r})"
    elif near is not None:
        message += f" (the closest that does is {near!r})"
    else:
        message += " (there is none)"
    if unreadable:
        message += f"; the manifests of {', '.join(map(repr, unreadable))} cannot be read, it may be one of theirs"
    return (
        message + "; a key is an endpoint's URL, a rubric's owner/name or a plugin's <environment>/<module>:<callable>"
    )


def _unknown_pin(name: str, names: set[str], root: Path) -> str:
    """Why the pin of ``name`` is refused, with the closest environment's name."""
    near = closest(name, names, cutoff=0.0)
    there = f"the closest that does is {near!r}" if near is not None else "there is none"
    return f"pins.{name}: names no environment under {root} ({there}); a pin is named as its environment's directory"
