"""The package's pointers into docs/design.md: each names a section the page has."""

from __future__ import annotations

import re
from pathlib import Path

import engine

PACKAGE = Path(engine.__file__).parent
DESIGN = PACKAGE.parent / "docs" / "design.md"


def _sections() -> list[str]:
    return [line[3:].strip() for line in DESIGN.read_text().splitlines() if line.startswith("## ")]


def _pointers() -> list[tuple[str, str]]:
    """Each mention of docs/design.md in the package's source, and the text that follows it."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = " ".join(path.read_text().split())  # a pointer may wrap onto the next line
        for match in re.finditer(r"docs/design\.md[,:]? \(?'?\"?", text):
            found.append((f"{path.relative_to(PACKAGE.parent)}", text[match.end() : match.end() + 80]))
    return found


def test_the_package_points_into_the_design_page() -> None:
    """The modules' designs live on one page: at least the transport's, the crash-safe finish's and the digest's."""
    named = {where for where, _ in _pointers()}
    assert {"engine/_http/transport.py", "engine/_backfill/writer.py", "engine/_environments/digest.py"} <= named


def test_every_pointer_names_a_section_of_the_design_page() -> None:
    sections = _sections()
    unnamed = [(where, rest) for where, rest in _pointers() if not any(rest.startswith(name) for name in sections)]
    assert unnamed == []


def test_every_public_name_has_its_reference_entry() -> None:
    """The reference is generated from the docstrings of the names its pages list: every public name is listed."""
    reference = PACKAGE.parent / "docs" / "reference"
    listed = set(re.findall(r"^::: engine\.(\w+)$", "\n".join(p.read_text() for p in reference.glob("*.md")), re.M))
    assert listed == set(engine.__all__)
