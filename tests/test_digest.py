"""The environment digest that gates plugin imports."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from special_files import SPECIAL_KINDS, make_special

from engine import DigestError, digest_directory
from engine._environments.digest import MAX_PATHS, Pin, pin_verdict, snapshot_directory


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "env"
    (root / "pkg").mkdir(parents=True)
    (root / "manifest.json").write_text('{"kind": "environment"}')
    (root / "verify.py").write_text("def score(task, trajectory):\n    return 1.0\n")
    (root / "pkg" / "helpers.py").write_text("X = 1\n")
    return root


def test_format_and_determinism(tree: Path, tmp_path: Path) -> None:
    digest = digest_directory(tree)
    assert digest.startswith("sha256:")
    assert len(digest) == len("sha256:") + 64
    int(digest.removeprefix("sha256:"), 16)
    assert digest_directory(tree) == digest
    assert digest_directory(str(tree)) == digest
    # where the directory lives does not matter, only what is in it
    copy = tmp_path / "elsewhere" / "other_name"
    shutil.copytree(tree, copy)
    assert digest_directory(copy) == digest


def test_changes_on_content_change(tree: Path) -> None:
    before = digest_directory(tree)
    (tree / "pkg" / "helpers.py").write_text("X = 2\n")
    assert digest_directory(tree) != before


def test_changes_on_rename_and_on_a_new_file(tree: Path) -> None:
    before = digest_directory(tree)
    (tree / "pkg" / "helpers.py").rename(tree / "pkg" / "helper.py")
    renamed = digest_directory(tree)
    assert renamed != before
    (tree / "empty.txt").write_bytes(b"")
    assert digest_directory(tree) not in {before, renamed}


def test_file_boundaries_matter(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    (one / "a").write_bytes(b"bc")
    (two / "ab").write_bytes(b"c")
    assert digest_directory(one) != digest_directory(two)


def test_ignores_python_caches(tree: Path) -> None:
    before = digest_directory(tree)
    for cache in (tree / "__pycache__", tree / "pkg" / "__pycache__", tree / ".mypy_cache"):
        cache.mkdir()
        (cache / "verify.cpython-311.pyc").write_bytes(b"\x00compiled")
    (tree / "stray.pyc").write_bytes(b"\x00compiled")
    (tree / "pkg" / "old.pyo").write_bytes(b"\x00compiled")
    assert digest_directory(tree) == before


def test_not_a_directory(tree: Path) -> None:
    with pytest.raises(NotADirectoryError):
        digest_directory(tree / "verify.py")
    with pytest.raises(NotADirectoryError):
        digest_directory(tree / "missing")


@pytest.mark.timeout(20)
def test_command_line_prints_the_same_digest(tree: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "engine", "digest", str(tree)], capture_output=True, text=True, check=False, timeout=15
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == digest_directory(tree) + "\n"


@pytest.mark.timeout(20)
def test_command_line_refuses_a_missing_directory(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "engine", "digest", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        check=False,
        timeout=15,
    )
    assert done.returncode == 2
    assert "does not exist" in done.stderr


def test_follows_linked_directories_and_files(tree: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "lib.py").write_text("WEIGHT = 1\n")
    (shared / "data.txt").write_text("a\n")
    (tree / "lib").symlink_to(shared, target_is_directory=True)
    (tree / "data.txt").symlink_to(shared / "data.txt")
    before = digest_directory(tree)

    (shared / "lib.py").write_text("WEIGHT = 2\n")  # code reached through a linked directory
    after_lib = digest_directory(tree)
    assert after_lib != before
    (shared / "data.txt").write_text("b\n")  # a linked file
    assert digest_directory(tree) not in {before, after_lib}


def test_a_link_loop_is_not_followed_forever(tree: Path) -> None:
    (tree / "pkg" / "up").symlink_to(tree, target_is_directory=True)
    (tree / "pkg" / "self").symlink_to(tree / "pkg", target_is_directory=True)
    first = digest_directory(tree)
    assert digest_directory(tree) == first
    (tree / "pkg" / "helpers.py").write_text("X = 3\n")
    assert digest_directory(tree) != first


def test_dangling_link_counts_by_its_target(tree: Path) -> None:
    (tree / "model.bin").symlink_to(tree / "nowhere-1")
    first = digest_directory(tree)
    (tree / "model.bin").unlink()
    (tree / "model.bin").symlink_to(tree / "nowhere-2")
    assert digest_directory(tree) != first


@pytest.mark.parametrize("kind", SPECIAL_KINDS)
def test_refuses_what_is_not_a_regular_file_or_directory(tree: Path, kind: str) -> None:
    """Naming it, at once: never by opening it (a FIFO's open blocks, /dev/zero has no end)."""
    special = tree / "pkg" / "data.bin"
    what = make_special(special, kind)
    with pytest.raises(DigestError) as info:
        digest_directory(tree)
    assert info.value.path == special
    assert str(info.value).startswith(f"{special}")
    assert f"is {what}, not a regular file or directory" in str(info.value)
    if kind == "link-to-dev-zero":
        assert f"{special} (a link to /dev/zero) is a character device" in str(info.value)


@pytest.mark.timeout(40)
@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-zero"])
def test_command_line_refuses_a_special_file(tree: Path, kind: str) -> None:
    special = tree / "pipe"
    what = make_special(special, kind)
    done = subprocess.run(
        [sys.executable, "-m", "engine", "digest", str(tree)], capture_output=True, text=True, check=False, timeout=30
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(f"error: {special}")
    assert f"is {what}, not a regular file or directory" in done.stderr


def test_a_snapshot_keeps_the_sources_it_hashed(tree: Path) -> None:
    (tree / "data.txt").write_text("not code\n")
    snapshot = snapshot_directory(tree)
    assert snapshot.digest == digest_directory(tree)
    assert snapshot.root == tree
    assert dict(snapshot.sources) == {
        "verify.py": (tree / "verify.py").read_bytes(),
        "pkg/helpers.py": (tree / "pkg" / "helpers.py").read_bytes(),
    }


def documented_digest(root: Path) -> str:
    """The digest as docs/design.md (Snapshots) defines it, computed here from ``os.walk`` (no links, no caches)."""
    h = hashlib.sha256()
    paths = [os.path.join(d, n) for d, _, names in os.walk(root) for n in names]
    files = sorted((os.path.relpath(full, root).encode(), full) for full in paths)
    for rel, full in files:
        data = Path(full).read_bytes()
        h.update(rel + b"\0" + str(len(data)).encode() + b"\0" + data)
    return f"sha256:{h.hexdigest()}"


def test_the_digest_is_the_documented_format_with_utf8_names_as_their_bytes(tree: Path) -> None:
    """Pins made before names were hashed as raw bytes still hold: a UTF-8 name's bytes did not change."""
    (tree / "données-é.txt").write_text("accents\n")
    assert digest_directory(tree) == documented_digest(tree)


@pytest.mark.timeout(40)
def test_a_name_or_link_target_that_is_not_utf8_is_hashed(tree: Path) -> None:
    """``data\\xff.txt`` is a valid file name on Linux; the digest hashed its name as UTF-8 and crashed."""
    odd = os.path.join(os.fsencode(tree), b"data\xff.txt")
    with open(odd, "wb") as f:
        f.write(b"bytes\n")
    first = digest_directory(tree)
    os.rename(odd, os.path.join(os.fsencode(tree), b"data\xfe.txt"))  # another non-UTF-8 name: another digest
    second = digest_directory(tree)
    assert second != first
    os.symlink(b"nowhere-\xff", os.path.join(os.fsencode(tree), b"dangling"))
    assert digest_directory(tree) not in {first, second}
    done = subprocess.run(
        [sys.executable, "-m", "engine", "digest", str(tree)], capture_output=True, text=True, check=False, timeout=30
    )
    assert (done.returncode, done.stdout) == (0, digest_directory(tree) + "\n"), done.stderr


def make_dag(root: Path, depth: int) -> None:
    """A chain of ``depth`` directories, each with two links to the next: 2^depth paths, and no loop."""
    for level in range(depth + 1):
        (root / f"d{level}").mkdir()
    for level in range(depth):
        for link in ("a", "b"):
            (root / f"d{level}" / link).symlink_to(Path("..", f"d{level + 1}"), target_is_directory=True)
    (root / f"d{depth}" / "f.txt").write_text("hi\n")


def test_a_walk_past_its_path_limit_is_refused(tree: Path) -> None:
    make_dag(tree, 6)  # d0 alone reaches f.txt by 64 paths
    snapshot_directory(tree, max_paths=1000)  # within the limit: every path is hashed
    with pytest.raises(DigestError) as info:
        snapshot_directory(tree, max_paths=50)
    assert info.value.path == tree
    assert str(info.value).startswith(f"{tree} holds more than 50 files (links followed)")


@pytest.mark.timeout(120)
def test_command_line_refuses_a_directory_with_too_many_paths(tree: Path) -> None:
    make_dag(tree, 18)  # 2^18 paths to f.txt: past MAX_PATHS long before the end
    done = subprocess.run(
        [sys.executable, "-m", "engine", "digest", str(tree)], capture_output=True, text=True, check=False, timeout=90
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(f"error: {tree} holds more than {MAX_PATHS} files (links followed)"), done.stderr


def test_a_walk_past_its_byte_limit_is_refused(tree: Path) -> None:
    total = sum(len(p.read_bytes()) for p in tree.rglob("*") if p.is_file())
    snapshot_directory(tree, max_bytes=total)  # exactly the limit: fine
    (tree / "data.bin").write_bytes(b"x")
    with pytest.raises(DigestError) as info:
        snapshot_directory(tree, max_bytes=total)
    assert f"holds more than {total} bytes" in str(info.value)


PROC_FILES = [  # regular files to stat, of size 0, that a digest must refuse rather than read
    # /proc/self/pagemap reads ~256 GiB: refused after one page
    pytest.param(
        Path("/proc/self/pagemap"), "reads more bytes than its size (0): it is not a plain file", id="reads-more"
    ),
    # /proc/self/mem's first page reads as an I/O error: a DigestError, not a raw OSError
    pytest.param(
        Path("/proc/self/mem"), "cannot be read (Input/output error), so it cannot be vetted", id="cannot-be-read"
    ),
]


@pytest.mark.timeout(40)
@pytest.mark.parametrize(("target", "why"), PROC_FILES)
def test_a_file_that_does_not_read_as_a_plain_file_is_refused_naming_it(tree: Path, target: Path, why: str) -> None:
    if not target.exists():
        pytest.skip(f"needs Linux's {target}")
    link = tree / "data.bin"
    link.symlink_to(target)
    with pytest.raises(DigestError) as info:
        digest_directory(tree)
    assert info.value.path == link
    assert str(info.value).startswith(f"{link} (a link to /proc/"), info.value
    assert why in str(info.value)
    done = subprocess.run(
        [sys.executable, "-m", "engine", "digest", str(tree)], capture_output=True, text=True, check=False, timeout=30
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(f"error: {link} (a link to /proc/"), done.stderr


def test_a_snapshot_keeps_the_manifest_it_hashed(tree: Path) -> None:
    assert snapshot_directory(tree).manifest == (tree / "manifest.json").read_bytes()
    (tree / "pkg" / "manifest.json").write_text("{}")  # only the root's is the environment's manifest
    assert snapshot_directory(tree).manifest == (tree / "manifest.json").read_bytes()
    (tree / "manifest.json").unlink()
    assert snapshot_directory(tree).manifest is None


@pytest.mark.parametrize(
    ("pin", "required", "verdict"),
    [
        ("sha256:aa", False, Pin.MATCHES),
        ("sha256:aa", True, Pin.MATCHES),
        ("sha256:bb", False, Pin.CHANGED),  # a pin is held to even where none is required
        (None, True, Pin.MISSING),
        (None, False, Pin.NOT_NEEDED),
    ],
)
def test_the_pin_verdict(pin: str | None, required: bool, verdict: Pin) -> None:
    """The one rule the plugin verifier and ``engine check`` both apply to a directory's digest and its pin."""
    assert pin_verdict("sha256:aa", pin, required=required) is verdict
