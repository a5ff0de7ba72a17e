"""The adapters stand on the engine's public face: they import ``engine`` and each other, never a private
module of the engine (``engine._*``, but for the exceptions below) nor any trainer (none is installed
where they are imported)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from cli_support import child_env

import engine

ADAPTERS = Path(engine.__file__).parent / "adapters"
TRAINERS = {"trl", "verl", "openrlhf", "slime", "verifiers", "torch", "ray", "transformers"}
# The one private import allowed: OpenRLHF's samples map to items in one place, which `engine serve`'s
# /get_reward uses too. engine._openrlhf is a pure function at the bottom of the package (it imports
# nothing of the engine's) and ships with the adapters in the same package, so nothing can drift; made a
# public name instead, a protocol detail of one trainer would be pinned in engine's API for every user.
#
# And the adapters' runtime builds on the engine's own thread that runs an event loop for synchronous callers
# (``BlockingEngine``'s too), so that it exists once; it sits in engine._core, and the trainers' modules still
# see only the public face and the runtime.
ALLOWED = {
    "openrlhf.py": {"engine._openrlhf"},
    "_runtime.py": {"engine._core.batcher", "engine._core.portal"},
}


def imported(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def test_adapters_import_only_the_public_engine_and_no_trainer() -> None:
    modules = sorted(ADAPTERS.glob("*.py"))
    assert {path.stem for path in modules} >= {"trl", "verl", "openrlhf", "slime", "verifiers"}
    for path in modules:
        names = imported(path)
        private = {name for name in names if name.startswith("engine.") and not name.startswith("engine.adapters")}
        assert private == ALLOWED.get(path.name, set()), (path.name, private)
        assert {name.split(".")[0] for name in names} & TRAINERS == set(), path.name


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_adapters_use_no_private_name_of_another_module() -> None:
    """Public API only, of the standard library too: a private name (``threading._register_atexit``, say)
    may change or go in any release."""
    for path in sorted(ADAPTERS.glob("*.py")):
        tree = ast.parse(path.read_text())
        nodes = list(ast.walk(tree))
        modules = {alias.asname or alias.name.split(".")[0]
                   for node in nodes if isinstance(node, ast.Import) for alias in node.names}
        used = {f"{node.value.id}.{node.attr}" for node in nodes if isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name) and node.value.id in modules and is_private(node.attr)}
        used |= {f"{node.module}.{alias.name}" for node in nodes if isinstance(node, ast.ImportFrom)
                 and node.level == 0 and not (node.module or "").startswith("engine.adapters")
                 for alias in node.names if is_private(alias.name)}
        assert used == set(), (path.name, used)


def test_importing_every_adapter_imports_no_trainer_and_starts_nothing() -> None:
    probe = (
        "import sys, threading\n"
        "import engine.adapters.trl, engine.adapters.verl, engine.adapters.openrlhf, engine.adapters.slime, "
        "engine.adapters.verifiers\n"
        f"print(sorted(set(sys.modules) & set({sorted(TRAINERS)!r})), threading.active_count())\n"
    )
    command = [sys.executable, "-c", probe]
    done = subprocess.run(command, env=child_env(None), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "1"]  # no trainer module, no thread: an engine opens on first use


EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "trainers"
NEEDS = {"trl_grpo": "trl", "verl_ppo": "verl", "openrlhf_ppo": "openrlhf", "slime_grpo": "slime",
         "verifiers_eval": "verifiers"}


def test_each_trainer_example_says_so_when_its_trainer_is_not_installed() -> None:
    import importlib.util

    assert sorted(path.stem for path in EXAMPLES.glob("*.py")) == sorted(NEEDS)
    for name, trainer in NEEDS.items():
        if importlib.util.find_spec(trainer) is not None:
            continue  # installed: the script would train
        command = [sys.executable, str(EXAMPLES / f"{name}.py")]
        done = subprocess.run(command, env=child_env(None), capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout) == (1, ""), (name, done.stderr)
        assert " is not installed: " in done.stderr, (name, done.stderr)
        assert "Traceback" not in done.stderr, name
