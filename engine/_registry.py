"""The registry: each environment's verifier and meter, built once and kept while the engine is open.

An environment's name resolves to its :class:`~engine._environments.manifest.Environment` (its
manifest, read once for the engine's life), then to its verifier. Plugins and endpoints are built
once and live as long as the engine is open (imports and connections are reused); a rubric is
resolved anew for each batch (:meth:`Registry.resolver`), so every item of a batch is judged against
the same version even if a new one appears while it runs. A verifier's limits are one
:class:`~engine._core.meters.Meter`, kept by its key, shared by every batch the engine scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio

from engine._config import EngineConfig
from engine._core.contract import ENV_NAME, Verifier
from engine._core.meters import Meter
from engine._core.scheduler import Resolve
from engine._environments.manifest import Environment, load_environment
from engine._errors import VerificationError
from engine._http.network import Routes
from engine._http.retry import Sleep
from engine._verifiers.endpoint.verifier import EndpointVerifier
from engine._verifiers.plugin.verifier import PluginVerifier
from engine._verifiers.rubric.judge import Judge
from engine._verifiers.rubric.registry import RubricRegistry
from engine._verifiers.rubric.verifier import RubricVerifier

__all__ = ["Registry", "Shared"]


@dataclass(frozen=True)
class Shared:
    """What an open engine lends its verifiers: the routes to every URL, the threads of sync plugins, the judge."""

    routes: Routes
    threads: anyio.CapacityLimiter
    judge: Judge | None


class Registry:
    """Environment name -> environment -> verifier and meter, each built once; ``sleep`` is what retries wait with."""

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

    def environment(self, name: str) -> Environment:
        """The environment called ``name``, loaded once; ``ValueError`` if there is none."""
        env = self._environments.get(name)
        if env is None:
            if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an environment's directory name")
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
                    raise VerificationError("rubric", spec.ref, "no [judge] is configured to grade rubrics")
                verifier = rubrics[spec.ref] = RubricVerifier(self.rubrics.resolve(spec.ref), shared.judge)
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
                verifier = EndpointVerifier(spec.ref, limits, shared.routes.transport_for(spec.ref), sleep=self._sleep)
            self._verifiers[key] = verifier
        return verifier

    def meter(self, key: str) -> Meter:
        """The live limits of the verifier configured under ``key``, shared by every batch."""
        meter = self._meters.get(key)
        if meter is None:
            meter = self._meters[key] = Meter.from_limits(self.config.limits_for(key))
        return meter

    def resolver(self) -> Resolve:
        """What resolves one batch's environments: each rubric once, so all its items are judged alike."""
        rubrics: dict[str, Verifier] = {}

        def resolve(name: str) -> tuple[Verifier, Meter]:
            verifier = self.verifier_for(self.environment(name), rubrics)
            return verifier, self.meter(verifier.key)

        return resolve
