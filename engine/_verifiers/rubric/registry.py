"""Rubrics: a team's written grading standards, as numbered, immutable files ``<root>/<owner>/<name>/<N>.md``.

Their front matter, and how a batch is judged against one version: docs/design.md, The judge (Rubrics).
"""

from __future__ import annotations

import builtins
import hashlib
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine._environments.manifest import RUBRIC_REF
from engine._errors import RubricError

__all__ = ["DEFAULT_SCALE", "Rubric", "RubricRegistry", "parse_rubric"]

DEFAULT_SCALE: tuple[float, float] = (0.0, 1.0)
FENCE = "+++"
_VERSION_FILE = re.compile(r"([1-9][0-9]*)\.md")


@dataclass(frozen=True, kw_only=True)
class Rubric:
    """One resolved rubric version. ``text`` is the Markdown body, without the front matter."""

    owner: str
    name: str
    version: int
    text: str
    digest: str  # "sha256:<hex>" of the file's bytes
    path: Path
    scale: tuple[float, float] = DEFAULT_SCALE

    @property
    def ref(self) -> str:
        """The pinned ref of this version, ``owner/name@N``."""
        return f"{self.owner}/{self.name}@{self.version}"


def _scale(value: Any) -> tuple[float, float]:
    """The ``scale`` front matter value, checked; raises ``ValueError`` saying what is wrong."""
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"scale must be [lo, hi], got {value!r}")
    for bound in value:
        if isinstance(bound, bool) or not isinstance(bound, int | float):
            raise ValueError(f"scale must be two numbers, got {value!r}")
    lo, hi = float(value[0]), float(value[1])
    # hi - lo must be finite too, or normalising a score would divide by infinity
    if not (math.isfinite(lo) and math.isfinite(hi) and math.isfinite(hi - lo)):
        raise ValueError(f"scale must be finite numbers, got {value!r}")
    if lo >= hi:
        raise ValueError(f"scale must be [lo, hi] with lo < hi, got {value!r}")
    return lo, hi


def parse_rubric(data: bytes) -> tuple[str, tuple[float, float]]:
    """The text and scale of a rubric file's bytes; raises ``ValueError`` saying what is wrong."""
    try:
        source = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc})") from None
    lines = source.splitlines(keepends=True)
    # Front matter starts at the first non-blank line: a stray blank line above it must not
    # silently turn it into rubric text (and the scale into the default).
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    front: dict[str, Any] = {}
    body = source
    if first is not None and lines[first].strip() == FENCE:
        close = next((i for i in range(first + 1, len(lines)) if lines[i].strip() == FENCE), None)
        if close is None:
            raise ValueError(f"front matter opened by '{FENCE}' on line {first + 1} is never closed")
        try:
            front = tomllib.loads("".join(lines[first + 1 : close]))
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"front matter is not valid TOML: {exc}") from None
        body = "".join(lines[close + 1 :])
    scale = _scale(front["scale"]) if "scale" in front else DEFAULT_SCALE
    text = body.strip()
    if not text:
        raise ValueError("has no rubric text (the body after the front matter is empty)")
    return text, scale


class RubricRegistry:
    """The rubrics under one directory, ``<root>/<owner>/<name>/<N>.md``; reads the files on every call, so
    new versions show up."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _versions(self, directory: Path) -> builtins.list[int]:
        try:
            names = [entry.name for entry in directory.iterdir() if entry.is_file()]
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(int(m.group(1)) for n in names if (m := _VERSION_FILE.fullmatch(n)))

    def resolve(self, ref: str) -> Rubric:
        """The rubric ``owner/name`` (latest version) or ``owner/name@N``; raises ``RubricError``.

        A ref that is not of either form is a ``ValueError`` (manifests are checked on load, so
        only a caller's typo gets here).
        """
        match = RUBRIC_REF.fullmatch(ref) if isinstance(ref, str) else None
        if match is None:
            raise ValueError(f"rubric ref {ref!r} must be 'owner/name' or 'owner/name@N'")
        owner, name = match["owner"], match["name"]
        key = f"{owner}/{name}"  # its limits' and reports' name: every version's
        directory = self.root / owner / name
        versions = self._versions(directory)
        if not versions:
            raise RubricError(
                ref, f"no rubric {owner}/{name}: no version files (1.md, 2.md, ...) in {directory}", key=key
            )
        if match["version"] is None:
            version = versions[-1]
        else:
            version = int(match["version"])
            if version not in versions:
                shown = ", ".join(map(str, versions))
                raise RubricError(ref, f"rubric {owner}/{name} has no version {version} (it has {shown})", key=key)
        path = directory / f"{version}.md"
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise RubricError(ref, f"cannot read {path}: {exc}", key=key) from exc
        try:
            text, scale = parse_rubric(data)
        except ValueError as exc:
            raise RubricError(ref, f"{path}: {exc}", key=key) from None
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        return Rubric(owner=owner, name=name, version=version, text=text, digest=digest, path=path, scale=scale)

    def list(self) -> dict[str, builtins.list[int]]:
        """Every rubric, ``owner/name`` -> its versions in ascending order; empty if the directory is missing."""
        found: dict[str, builtins.list[int]] = {}
        try:
            owners = sorted(entry for entry in self.root.iterdir() if entry.is_dir())
        except (FileNotFoundError, NotADirectoryError):
            return found
        for owner in owners:
            for directory in sorted(entry for entry in owner.iterdir() if entry.is_dir()):
                key = f"{owner.name}/{directory.name}"
                versions = self._versions(directory)
                if versions and RUBRIC_REF.fullmatch(key):
                    found[key] = versions
        return found
