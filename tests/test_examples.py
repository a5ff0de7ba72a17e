"""The shipped examples as a new user meets them: the math-verify environment and what ``make run`` prints.

The math environment runs through the engine as ``make run`` runs it: examples/engine.toml, its
pin, worker processes and the real math-verify. Its rewards are checked against fractions computed
here, without math-verify.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
import pytest
from asserts import check_error
from cli_support import fraction_sum_reward

from engine import BlockingEngine, VerificationError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# seconds per math call in the test of a slow item (the example's own is 10): it bounds the workers' import of
# math-verify too, ~2 s each on a loaded machine, two at once; the slow item runs for minutes past it
SLOW_TIMEOUT = 8.0


def math_rows() -> list[dict[str, Any]]:
    rows = [orjson.loads(line) for line in (EXAMPLES / "rollouts.jsonl").read_bytes().splitlines() if line.strip()]
    return [row for row in rows if row["environment"] == "math"]


@pytest.fixture
def examples(tmp_path: Path) -> Path:
    target = tmp_path / "examples"
    shutil.copytree(EXAMPLES, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return target


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_the_math_example_scores_with_math_verify_in_worker_processes(examples: Path) -> None:
    manifest = orjson.loads((examples / "envs" / "math" / "manifest.json").read_bytes())
    assert manifest["verifier"]["executor"] == "process"  # what the README's plugin section says it shows
    rows = math_rows()
    assert len(rows) == 60
    with BlockingEngine.from_config(examples / "engine.toml") as eng:
        rewards = eng.score(rows)
    assert rewards == [fraction_sum_reward(row) for row in rows]
    assert 0 < sum(rewards) < len(rows)  # right and wrong answers both


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_slow_math_item_is_an_error_never_a_zero(examples: Path) -> None:
    """math-verify's own timeouts are off: the engine's ``timeout`` bounds the call, and a call past it fails.

    9^(9^9) has ~370 million digits: sympy works on it far longer than any timeout. With math-verify's
    own alarm on, a timed-out comparison would come back as "no match", a 0.0.
    """
    config = examples / "engine.toml"
    text = config.read_text()
    assert "timeout = 10.0" in text
    config.write_text(text.replace("timeout = 10.0", f"timeout = {SLOW_TIMEOUT}"))
    slow = {"id": "huge", "environment": "math", "task": {"prompt": "What is 2?", "answer": "$2$"},
            "trajectory": "The answer is $\\boxed{9^{9^{9}}}$."}
    with BlockingEngine.from_config(config) as eng:
        with pytest.raises(VerificationError) as info:
            eng.score([math_rows()[0], slow])
        check_error(info.value, kind="plugin", ref="verify:score", environment="math", index=1, item_id="huge",
                    match=r".*timed out.*")
        assert eng.score(math_rows()[:3]) == [fraction_sum_reward(row) for row in math_rows()[:3]]  # a new worker


def math_item(trajectory: Any, answer: str = "$\\frac{3}{4}$") -> dict[str, Any]:
    return {"id": "it", "environment": "math", "task": {"prompt": "What is 1/2 + 1/4?", "answer": answer},
            "trajectory": trajectory}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_the_math_example_reads_content_given_as_a_list_of_parts(examples: Path) -> None:
    """OpenAI-style ``content`` parts are the answer's text, not messages to look for an assistant in (a 0.0)."""
    boxed = "So the sum is $\\boxed{\\frac{3}{4}}$."
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 1/2 + 1/4?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": boxed}]}]
    with_image = [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "data:,"}},
                                                    {"type": "text", "text": "So the sum is "},
                                                    {"type": "text", "text": "$\\boxed{\\frac{3}{4}}$."}]}]
    wrong = [{"role": "assistant", "content": [{"type": "text", "text": "So the sum is $\\boxed{\\frac{2}{6}}$."}]}]
    with BlockingEngine.from_config(examples / "engine.toml") as eng:
        assert eng.score([math_item(parts), math_item(with_image), math_item(wrong)]) == [1.0, 1.0, 0.0]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("trajectory", "match"),
    [
        ([{"role": "user", "content": "What is 1/2 + 1/4?"}], r".*no assistant message.*"),
        ([{"role": "assistant", "content": None}], r".*no text content \(content is NoneType\).*"),
        ([{"role": "assistant"}], r".*no text content \(content is NoneType\).*"),
        ({"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]},
         r".*has no text part.*"),
    ],
    ids=["no-assistant-message", "content-none", "content-missing", "no-text-part"],
)
def test_a_math_trajectory_without_assistant_text_is_an_error_never_a_zero(
    examples: Path, trajectory: Any, match: str
) -> None:
    right = math_item("So the sum is $\\boxed{\\frac{3}{4}}$.") | {"id": "right"}
    with BlockingEngine.from_config(examples / "engine.toml") as eng, pytest.raises(VerificationError) as info:
        eng.score([right, math_item(trajectory)])
    check_error(info.value, kind="plugin", ref="verify:score", environment="math", index=1, item_id="it", match=match)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_an_exception_inside_math_verify_is_an_error_never_a_zero(examples: Path) -> None:
    """sympy raising inside math-verify's comparison (an interval with a NaN end) fails the item.

    Without ``raise_on_error=True`` math-verify logs it at debug level and answers "no match": a 0.0.
    """
    nan_interval = "So the sum is $\\boxed{(1, \\frac{0}{0})}$."
    with BlockingEngine.from_config(examples / "engine.toml") as eng, pytest.raises(VerificationError) as info:
        eng.score([math_item(nan_interval)])
    check_error(info.value, kind="plugin", ref="verify:score", environment="math", index=0, item_id="it",
                match=r".*Invalid NaN comparison.*")


def load_run_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_run", EXAMPLES / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_run_prints_the_command_it_really_runs() -> None:
    """Not ``$ engine score ...`` (``engine`` is not on the PATH until the venv is activated): a line that runs."""
    run = load_run_script()
    command = run.score_command()
    line = run.shown(command)
    assert not line.startswith("engine ")
    program = Path(line.split()[0])
    program = program if program.is_absolute() else ROOT / program
    assert program.is_file() and os.access(program, os.X_OK), line
    assert line.split()[1:] == ["score", "examples/rollouts.jsonl", "-o", "out/rewards.jsonl",
                                "--config", "examples/engine.toml"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    helped = subprocess.run([str(program), "score", "--help"], cwd=ROOT, capture_output=True, text=True, env=env,
                            timeout=60, check=False)
    assert helped.returncode == 0 and "Backfill rewards" in helped.stdout, helped.stderr
    assert str(Path(sys.executable).parent) in str(program)  # the venv's own, beside this interpreter


def test_make_run_installs_what_it_needs_and_not_the_suites_tools_or_ray(tmp_path: Path) -> None:
    """``make run`` on a fresh machine installs the engine and the examples' verifier only: not Ray (840 MB),
    not the suite's tools; ``make test`` installs the suite's, the docs site's and Ray."""
    root = Path(__file__).resolve().parent.parent
    venv = tmp_path / "venv"  # absent: make plans every step a fresh machine takes

    def planned(target: str) -> list[str]:
        result = subprocess.run(["make", "-n", "-C", str(root), target, f"VENV={venv}"], capture_output=True,
                                text=True, check=True)
        return [line for line in result.stdout.splitlines() if "pip install" in line and "--upgrade pip" not in line]

    (run_install,) = planned("run")
    assert "'.[examples]'" in run_install and "ray" not in run_install and "dev" not in run_install
    test_installs = planned("test")
    assert any("'.[dev,ray,docs]'" in line for line in test_installs)
