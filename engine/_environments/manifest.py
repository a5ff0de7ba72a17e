"""Environments and their ``manifest.json``: one verifier of one of three kinds, read once and validated.

The manifest's fields: :func:`load_environment` and :class:`VerifierSpec`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

from engine._environments.digest import MANIFEST, open_regular
from engine._errors import DigestError, ManifestError
from engine._http.network import credentials_refusal, shown_url, url_problem, without_credentials
from engine._keys import first_unknown, unknown_key
from engine._reasons import a_or_an

__all__ = [
    "EXAMPLE_FIELD",
    "EXECUTORS",
    "KINDS",
    "MANIFEST_KEYS",
    "Environment",
    "VerifierSpec",
    "load_environment",
    "parse_verifier",
]

MAX_MANIFEST_BYTES = 1 << 20  # a manifest is a few lines of JSON; more is refused, not read
KINDS: tuple[str, ...] = ("rubric", "plugin", "endpoint")  # the three verifier kinds: no fourth, no built-in scorer
Kind = Literal["rubric", "plugin", "endpoint"]
EXECUTORS: tuple[str, ...] = ("thread", "process")
Executor = Literal["thread", "process"]
EXAMPLE_FIELD = "example"  # a manifest's optional sample item, {"task": ..., "trajectory": ...}: engine check scores it
# every key a manifest may hold; any other is refused, as a typo ("exmaple": an example never checked)
MANIFEST_KEYS: tuple[str, ...] = ("kind", "verifier", "version", "description", EXAMPLE_FIELD)
_VERIFIER_KEYS = ("kind", "ref")
_PLUGIN_KEYS = (*_VERIFIER_KEYS, "executor", "workers")

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
RUBRIC_REF = re.compile(rf"(?P<owner>{_NAME})/(?P<name>{_NAME})(?:@(?P<version>[1-9][0-9]*))?")
PLUGIN_REF = re.compile(rf"(?P<module>{_IDENT}(?:\.{_IDENT})*):(?P<attr>{_IDENT}(?:\.{_IDENT})*)")
ENDPOINT_REF = re.compile(r"https?://[^\s/?#]+[^\s]*", re.IGNORECASE)

_REF_FORMS = {
    "rubric": (RUBRIC_REF, "'owner/name' or 'owner/name@N'"),
    "plugin": (PLUGIN_REF, "'module:callable'"),
    "endpoint": (ENDPOINT_REF, "an http:// or https:// URL"),
}


@dataclass(frozen=True)
class VerifierSpec:
    """What a manifest says about its verifier: one of the three kinds and its ref.

    A plugin may also say where its sync callable runs:
    ``{"kind": "plugin", "ref": "verify:score", "executor": "process", "workers": 2}``.

    Attributes:
        kind: ``"plugin"``, ``"endpoint"`` or ``"rubric"``: there is no fourth kind and no built-in scorer.
        ref: A plugin's ``module:callable``, an endpoint's ``http://`` or ``https://`` URL, a rubric's
            ``owner/name`` (the latest version) or ``owner/name@N``.
        executor: A plugin's only. ``"thread"`` (the default): the engine's shared thread pool, in the
            engine's process. ``"process"``: worker processes of its own, each of which imports the plugin
            once and calls it in its main thread, so a call that hangs can be killed, a crash (a segfault,
            ``os._exit``) fails the item instead of the trainer, libraries that time themselves out with
            signals work, and CPU-bound code uses every core.
        workers: How many worker processes (the process executor only); ``None`` for the thread executor,
            and for the process executor when the manifest leaves the count to the engine (one worker
            per CPU the engine may run on).
    """

    kind: Kind
    ref: str
    executor: Executor = "thread"
    workers: int | None = None


@dataclass(frozen=True)
class Environment:
    """A loaded, validated environment directory.

    Attributes:
        name: The directory's name, which is the environment's.
        path: The directory.
        verifier: What its manifest says of its verifier.
        manifest: The manifest's JSON object, whole: beside ``kind`` and ``verifier`` it may hold
            ``version`` and ``description`` (descriptive) and ``example`` (``engine check``'s sample item),
            and no other key (:data:`MANIFEST_KEYS`).
        manifest_bytes: The manifest as read: a plugin runs only if the digest hashed these same bytes
            (``engine._verifiers.plugin``), so the verifier the engine was configured with is the one pinned.
    """

    name: str
    path: Path
    verifier: VerifierSpec
    manifest: Mapping[str, Any]
    manifest_bytes: bytes

    @property
    def verifier_key(self) -> str:
        """The verifier's name for limits and provenance (see ``engine._config``).

        A plugin is only meaningful inside its environment, so its key carries the environment's
        name; a rubric's key drops the version pin, so one rubric shares one set of limits.
        """
        spec = self.verifier
        if spec.kind == "plugin":
            return f"{self.name}/{spec.ref}"
        if spec.kind == "rubric":
            return spec.ref.partition("@")[0]
        return spec.ref


def parse_verifier(value: Any, where: Path) -> VerifierSpec:
    """Validate a manifest's ``verifier`` object; ``where`` (the manifest) prefixes error messages."""
    if not isinstance(value, Mapping):
        raise ManifestError(f"{where}: field 'verifier' must be an object with 'kind' and 'ref'")
    kind = value.get("kind")
    if kind not in KINDS:
        shown = "missing" if kind is None else f"{kind!r}"
        raise ManifestError(
            f"{where}: field 'verifier.kind' is {shown}; it must be one of 'rubric', 'plugin', 'endpoint' "
            "(there are exactly three kinds and no built-in scorer)"
        )
    known = _PLUGIN_KEYS if kind == "plugin" else _VERIFIER_KEYS
    if (key := first_unknown(value, known)) is not None:
        plugins_only = f"; {key!r} is for plugins only" if key in _PLUGIN_KEYS else ""
        raise ManifestError(unknown_key(key, known) + plugins_only, key=f"verifier.{key}", source=where)
    ref = value.get("ref")
    if kind == "endpoint" and isinstance(ref, str) and (plain := without_credentials(ref)) is not None:
        raise ManifestError(f"{where}: field 'verifier.ref': {credentials_refusal(plain)}")  # never echo the URL
    pattern, form = _REF_FORMS[kind]
    if not isinstance(ref, str) or not pattern.fullmatch(ref):
        given: Any = shown_url(ref) if kind == "endpoint" and isinstance(ref, str) else ref  # a password?
        raise ManifestError(f"{where}: field 'verifier.ref' is {given!r}; {a_or_an(kind)} ref must be {form}")
    if kind == "endpoint" and (problem := url_problem(ref)) is not None:
        raise ManifestError(f"{where}: field 'verifier.ref': {problem}")  # found now, not at the first call
    executor = value.get("executor", "thread")
    if executor not in EXECUTORS:
        raise ManifestError(
            f"{where}: field 'verifier.executor' is {executor!r}; it must be 'thread' (the engine's thread pool, "
            "the default) or 'process' (worker processes of the plugin's own)"
        )
    workers = value.get("workers")
    if workers is not None:
        if executor != "process":
            raise ManifestError(
                f"{where}: field 'verifier.workers' needs \"executor\": \"process\" (thread-executor plugins share "
                "the engine's thread pool, sized by the config's 'threads')"
            )
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ManifestError(f"{where}: field 'verifier.workers' must be a whole number >= 1, got {workers!r}")
    return VerifierSpec(kind=kind, ref=ref, executor=executor, workers=workers)


def _read_manifest(manifest_path: Path) -> bytes:
    """The bytes of ``manifest_path``, opened as the digest opens files, and at most ``MAX_MANIFEST_BYTES``.

    It is read before the digest, on the event loop: a FIFO there would block the loop forever and
    ``/dev/zero`` would fill memory, so anything but a regular file is refused, never read.
    """
    try:
        fd = open_regular(manifest_path)
    except FileNotFoundError:
        raise ManifestError(f"{manifest_path}: no manifest (an environment directory needs {MANIFEST})") from None
    except DigestError as exc:
        raise ManifestError(exc.reason) from None  # names the file and what it is
    except OSError as exc:
        raise ManifestError(f"{manifest_path}: cannot read: {exc}") from exc
    try:
        with open(fd, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)  # one byte more than allowed: enough to know it is too large
    except OSError as exc:
        raise ManifestError(f"{manifest_path}: cannot read: {exc}") from exc
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"{manifest_path}: larger than {MAX_MANIFEST_BYTES} bytes; a manifest is a few lines of JSON"
        )
    return raw


def load_environment(path: Path) -> Environment:
    """Load and validate the environment in a directory.

    Its ``manifest.json`` names exactly one verifier of one of three kinds::

        {"kind": "environment", "verifier": {"kind": "plugin", "ref": "verify:score"}}

    Args:
        path: The environment's directory; its name is the environment's name.

    Returns:
        The environment, its manifest read once (a regular file of at most 1 MiB).

    Raises:
        ManifestError: The manifest is missing, not a regular file, too large, not JSON, or not a valid
            environment manifest (its kind, its verifier's kind, ref, executor or workers, a key it does
            not take, at the top or in its verifier: named, with the closest key it does take).
    """
    manifest_path = path / MANIFEST
    raw = _read_manifest(manifest_path)
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ManifestError(f"{manifest_path}: invalid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ManifestError(f"{manifest_path}: must be a JSON object, got {type(data).__name__}")
    if data.get("kind") != "environment":
        raise ManifestError(f"{manifest_path}: field 'kind' must be 'environment', got {data.get('kind')!r}")
    if (key := first_unknown(data, MANIFEST_KEYS)) is not None:  # before 'verifier' is missing: "verifer" is a typo
        raise ManifestError(unknown_key(key, MANIFEST_KEYS), key=key, source=manifest_path)
    if "verifier" not in data:
        raise ManifestError(f"{manifest_path}: field 'verifier' is missing")
    spec = parse_verifier(data["verifier"], manifest_path)
    return Environment(name=path.name, path=path, verifier=spec, manifest=data, manifest_bytes=raw)
