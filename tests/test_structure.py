"""The package's structure, read from its source: every limiter is a meter, the core never asks a
verifier's or a transport's concrete class, and the scheduler depends only on the verifier contract,
meters, its book and report."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import engine

PACKAGE = Path(engine.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _name(node: ast.expr) -> str:
    """``anyio.Semaphore`` for ``anyio.Semaphore``, ``Semaphore`` for ``Semaphore``; "" for anything else."""
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _shown(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


LIMITERS = {"Semaphore", "CapacityLimiter", "Lock", "AsyncLimiter", "Condition", "BoundedSemaphore"}


def test_every_limiter_is_built_in_meters() -> None:
    """A semaphore, capacity limiter, lock or rate limiter of the event loop is built in one module only."""
    built = [
        f"{_shown(path)}:{node.lineno} {_name(node.func)}"
        for path in MODULES
        if path != PACKAGE / "_core" / "meters.py"
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.Call)
        and _name(node.func).rsplit(".", 1)[-1] in LIMITERS
        and not _name(node.func).startswith("threading.")  # a thread's lock is not a limit on calls
    ]
    assert built == []


CORE = ["_engine.py", "_registry.py", "_check.py", "_blocking.py", "_core/scheduler.py", "_core/report.py"]
CONCRETE = {"PluginVerifier", "EndpointVerifier", "RubricVerifier", "PoolTransport", "WorkerPool", "Judge"}


@pytest.mark.parametrize("module", CORE)
def test_the_core_asks_no_concrete_class(module: str) -> None:
    """The engine's core tells kinds apart through the ``Verifier`` protocol, never by ``isinstance``."""
    asked = [
        f"{module}:{node.lineno}"
        for node in ast.walk(_tree(PACKAGE / module))
        if isinstance(node, ast.Call)
        and _name(node.func) == "isinstance"
        and CONCRETE & {_name(part) for part in ast.walk(node.args[1]) if isinstance(part, ast.expr)}
    ]
    assert asked == []


def _imports(path: Path) -> set[str]:
    """The engine modules ``path`` imports from, anywhere in it (``typing.TYPE_CHECKING`` blocks too)."""
    found = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("engine"):
            found |= {node.module} if node.module != "engine._core" else {f"engine._core.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("engine")}
    return found


def test_the_scheduler_depends_only_on_the_contract_meters_book_and_report() -> None:
    core = {"engine._core.book", "engine._core.contract", "engine._core.meters", "engine._core.report"}
    allowed = core | {"engine._errors", "engine._reasons"}  # the error tree and its words: below every layer
    assert _imports(PACKAGE / "_core" / "scheduler.py") <= allowed


def test_the_engine_builds_no_verifier_itself() -> None:
    """Environment -> verifier is the registry's; the engine keeps the lifecycle and the public methods."""
    imported = _imports(PACKAGE / "_engine.py") | _imports(PACKAGE / "_check.py")
    verifiers = {name for name in imported if name.startswith("engine._verifiers.")}
    assert verifiers <= {"engine._verifiers.rubric.judge"}  # the judge: one per engine, opened with its client


def test_no_verifier_names_an_item() -> None:
    """A verifier raises ``Failure`` (why, in words): only the scheduler, which knows the item, makes the
    ``VerificationError`` that names it, so that an error's index is set once, where it is known."""
    named = [
        f"{_shown(path)}:{node.lineno}"
        for path in sorted((PACKAGE / "_verifiers").rglob("*.py"))
        if path.name != "registry.py"  # resolving a rubric, before any item: a RubricError for any caller
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.Name) and node.id in {"VerificationError", "RubricError"}
    ]
    assert named == []


def test_an_errors_item_is_set_only_when_it_is_made() -> None:
    """No module assigns a ``VerificationError``'s index, item id or environment after it was made
    (an object's own attributes, ``self.environment``, are not an error's)."""
    assigned = [
        f"{_shown(path)}:{node.lineno}"
        for path in MODULES
        if path != PACKAGE / "_errors.py"
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.Assign | ast.AugAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for part in (target.elts if isinstance(target, ast.Tuple) else [target])
        if isinstance(part, ast.Attribute)
        and part.attr in {"index", "item_id", "environment"}
        and _name(part.value) != "self"
    ]
    assert assigned == []
