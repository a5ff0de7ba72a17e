"""The rubric registry: listing, latest and pinned versions, and every way a rubric file can be unusable."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from engine import RubricError, VerificationError
from engine._verifiers.rubric.prompt import parse_score
from engine._verifiers.rubric.registry import Rubric, RubricRegistry, parse_rubric

RUBRICS = Path(__file__).parent / "rubrics"


def write(root: Path, ref: str, version: int, text: str) -> Path:
    path = root / ref / f"{version}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def rejected(root: Path, ref: str) -> RubricError:
    with pytest.raises(RubricError) as info:
        RubricRegistry(root).resolve(ref)
    err = info.value
    assert isinstance(err, VerificationError)
    assert (err.kind, err.ref) == ("rubric", ref)
    assert str(err).startswith(f"rubric verifier {ref!r} failed: ")
    return err


def test_list_gives_every_rubric_with_sorted_versions(tmp_path: Path) -> None:
    for version in (10, 2, 1):
        write(tmp_path, "alice/long", version, f"version {version}")
    write(tmp_path, "bob/short", 1, "only one")
    (tmp_path / "alice" / "long" / "README.md").write_text("not a version")
    (tmp_path / "alice" / "long" / "01.md").write_text("not a version either")
    (tmp_path / "alice" / "empty").mkdir()  # a rubric directory with no version yet
    (tmp_path / ".git" / "objects").mkdir(parents=True)
    assert RubricRegistry(tmp_path).list() == {"alice/long": [1, 2, 10], "bob/short": [1]}


def test_list_of_the_sample_rubrics() -> None:
    assert RubricRegistry(RUBRICS).list() == {"alice/arithmetic-correctness": [1, 2], "bob/helpfulness": [1]}


def test_list_of_a_missing_directory_is_empty(tmp_path: Path) -> None:
    assert RubricRegistry(tmp_path / "nowhere").list() == {}


def test_latest_and_pinned_versions() -> None:
    registry = RubricRegistry(RUBRICS)
    latest = registry.resolve("alice/arithmetic-correctness")
    pinned = registry.resolve("alice/arithmetic-correctness@1")
    assert (latest.version, latest.ref, latest.scale) == (2, "alice/arithmetic-correctness@2", (0.0, 10.0))
    assert latest.text.startswith("# Arithmetic correctness, with partial credit")
    assert "+++" not in latest.text and "description" not in latest.text
    assert (pinned.version, pinned.ref, pinned.scale) == (1, "alice/arithmetic-correctness@1", (0.0, 1.0))
    assert pinned.text.startswith("# Arithmetic correctness\n")
    assert pinned.path == RUBRICS / "alice" / "arithmetic-correctness" / "1.md"
    assert (pinned.owner, pinned.name) == ("alice", "arithmetic-correctness")


def test_digest_is_of_the_file_bytes_and_follows_them(tmp_path: Path) -> None:
    path = write(tmp_path, "alice/d", 1, "+++\nscale = [0, 4]\n+++\nthe text\n")
    first = RubricRegistry(tmp_path).resolve("alice/d")
    assert first.digest == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    path.write_text("+++\nscale = [0, 5]\n+++\nthe text\n")  # same text, another scale: another digest
    assert RubricRegistry(tmp_path).resolve("alice/d").digest != first.digest


def test_a_new_version_becomes_latest_but_a_resolved_rubric_stays(tmp_path: Path) -> None:
    registry = RubricRegistry(tmp_path)
    write(tmp_path, "alice/r", 1, "one")
    resolved = registry.resolve("alice/r")
    write(tmp_path, "alice/r", 2, "two")
    assert (resolved.version, resolved.text) == (1, "one")
    assert (registry.resolve("alice/r").version, registry.resolve("alice/r").text) == (2, "two")


def test_missing_rubric(tmp_path: Path) -> None:
    write(tmp_path, "alice/r", 1, "one")
    err = rejected(tmp_path, "alice/nope")
    assert "no rubric alice/nope" in err.reason and str(tmp_path / "alice" / "nope") in err.reason
    assert "no rubric carol/r" in rejected(tmp_path, "carol/r@1").reason


def test_missing_version(tmp_path: Path) -> None:
    write(tmp_path, "alice/r", 1, "one")
    write(tmp_path, "alice/r", 3, "three")
    err = rejected(tmp_path, "alice/r@2")
    assert "has no version 2 (it has 1, 3)" in err.reason


@pytest.mark.parametrize("ref", ["alice", "alice/r@0", "alice/r@v2", "/r", "alice/r/x", "../etc/passwd", ""])
def test_a_ref_of_the_wrong_form_is_a_value_error(tmp_path: Path, ref: str) -> None:
    with pytest.raises(ValueError, match="must be 'owner/name' or 'owner/name@N'"):
        RubricRegistry(tmp_path).resolve(ref)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("+++\nscale = [0, 10]\nthe text, but the front matter never closes\n", "never closed"),
        ("+++\nscale = [0, 10\n+++\ntext\n", "front matter is not valid TOML"),
        ("+++\nscale = 0..10\n+++\ntext\n", "front matter is not valid TOML"),
        ("", "has no rubric text"),
        ("  \n\n\t\n", "has no rubric text"),
        ("+++\nscale = [0, 10]\n+++\n\n   \n", "has no rubric text"),
    ],
)
def test_malformed_file(tmp_path: Path, text: str, reason: str) -> None:
    path = write(tmp_path, "alice/bad", 1, text)
    err = rejected(tmp_path, "alice/bad")
    assert reason in err.reason and str(path) in err.reason, err.reason


def test_a_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "alice" / "bad" / "1.md"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"caf\xe9 rubric")
    assert "not UTF-8" in rejected(tmp_path, "alice/bad@1").reason


@pytest.mark.parametrize(
    ("scale", "reason"),
    [
        ("[1, 1]", "lo < hi"),
        ("[10, 0]", "lo < hi"),
        ('["0", "10"]', "two numbers"),
        ("[true, 10]", "two numbers"),
        ("[0]", "[lo, hi]"),
        ("[0, 5, 10]", "[lo, hi]"),
        ("10", "[lo, hi]"),
        ("[0, inf]", "finite"),
        ("[nan, 1]", "finite"),
        ("[-1.7e308, 1.7e308]", "finite"),
    ],
)
def test_bad_scale(tmp_path: Path, scale: str, reason: str) -> None:
    write(tmp_path, "alice/scaled", 1, f"+++\nscale = {scale}\n+++\ngrade it\n")
    err = rejected(tmp_path, "alice/scaled")
    assert "scale" in err.reason and reason in err.reason, err.reason


def test_front_matter_may_follow_blank_lines_and_carry_other_keys() -> None:
    text, scale = parse_rubric(b"\n\n+++\r\nscale = [-1.5, 2]\r\nauthor = 'alice'\r\n+++\r\n\r\nBe fair.\r\n")
    assert (text, scale) == ("Be fair.", (-1.5, 2.0))


def test_plus_signs_later_in_the_text_are_text() -> None:
    text, scale = parse_rubric(b"Score it.\n+++\nscale = [0, 10]\n+++\n")
    assert text == "Score it.\n+++\nscale = [0, 10]\n+++" and scale == (0.0, 1.0)


def test_a_score_is_held_to_its_scale_and_normalised() -> None:
    # one place checks a judge's score against the rubric's scale and maps it to 0..1
    assert parse_score('{"score": 7}', (0.0, 10.0)) == pytest.approx(0.7)
    assert parse_score('{"score": 1}', (1.0, 5.0)) == 0.0 and parse_score('{"score": 5}', (1.0, 5.0)) == 1.0
    assert parse_score('{"score": 0.0}', (-1.0, 1.0)) == 0.5
    with pytest.raises(ValueError, match="outside the rubric's scale"):
        parse_score('{"score": 10.5}', (0.0, 10.0))


def test_rubric_ref() -> None:
    rubric = Rubric(owner="o", name="n", version=4, text="t", digest="sha256:00", path=Path("o/n/4.md"))
    assert rubric.ref == "o/n@4" and rubric.scale == (0.0, 1.0)
