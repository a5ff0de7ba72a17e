# ruff: noqa: F811  (the fixtures imported from engine_fixtures are parameters of the tests below)
"""slime 0.3.1's own ``generate_rollout`` (slime.rollout.sglang_rollout) and rm_hub calling
``--custom-rm-path engine.adapters.slime.custom_rm``, with and without ``--group-rm``, on arguments
parsed by slime's own argument provider and prompts read by its own data source.

Run in the slime venv with slime's source on PYTHONPATH:
``ENGINE_TRAINER=slime PYTHONPATH=.:tests:../shared/thirdparty/slime-624b824 pytest tests/trainers/test_slime.py``.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import slime
from engine_fixtures import configured, envs_with_arithmetic, in_process, served  # noqa: F401  (fixtures)
from polling import wait_until
from servers import Server
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sglang_rollout import generate_rollout
from slime.utils.http_utils import init_http_client
from slime_support import fresh_state, parse, slime_parser, tiny_tokenizer, truth

import engine
from engine.adapters.slime import item

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "trainers" / "slime.md"
sys.path.insert(0, str(ROOT / "examples" / "trainers"))
import slime_grpo  # noqa: E402  (the example, imported for its launch line and its prompt file)

GENERATE = "slime_support.generate"


def test_the_pinned_source() -> None:
    assert Path(slime.__file__).resolve().parts[-3] == "slime-624b824"  # ../shared/thirdparty, never a copy


class Recording(RolloutDataSourceWithBuffer):
    """slime's own data source, keeping the groups it hands out (slime copies the dataset's samples)."""

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        self.handed: list[list[Any]] = []

    def get_samples(self, num_samples: int) -> list[list[Any]]:
        groups = super().get_samples(num_samples)
        self.handed.extend(groups)
        return groups


@pytest.fixture(scope="module")
def router() -> Iterator[str]:
    """What slime asks for its SGLang workers when a rollout ends: none."""
    with Server.json(lambda request: {"workers": []}) as server:
        yield server.url


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def prompts(path: Path, groups: int, bad: int | None = None) -> list[dict[str, Any]]:
    """A prompt file of ``groups`` arithmetic rows (row ``bad`` in the failing environment)."""
    rows = []
    for n in range(groups):
        question = f"What is {10 + n} {'+*-'[n % 3]} {3 + n % 5}?"
        rows.append({"prompt": question, "label": truth(question), "metadata": {"environment": "arithmetic"}})
    if bad is not None:
        rows[bad]["metadata"] = {"environment": "faulty", "mode": "raise"}
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def launch(data: Path, checkpoint: Path, groups: int, group_rm: bool) -> list[str]:
    line = ["--hf-checkpoint", str(checkpoint), "--prompt-data", str(data), "--input-key", "prompt",
            "--label-key", "label", "--metadata-key", "metadata", "--custom-rm-path", "engine.adapters.slime.custom_rm",
            "--custom-generate-function-path", GENERATE, "--rollout-batch-size", str(groups),
            "--n-samples-per-prompt", "4", "--rollout-temperature", "1.0"]
    return line + (["--group-rm"] if group_rm else [])


def run_rollout(line: list[str], router: str) -> tuple[Recording, Any]:
    args = parse(line, router)
    init_http_client(args)
    fresh_state()
    source = Recording(args)
    return source, lambda: generate_rollout(args, 0, source)  # type: ignore[return-value]


def expected_reward(prompt: str) -> float:
    return 0.0 if "-" in prompt else 1.0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("group_rm", [True, False], ids=["group-rm", "per-sample"])
def test_a_rollout_gets_every_reward_in_order(configured: str, group_rm: bool, router: str, checkpoint: Path,
                                              tmp_path: Path) -> None:
    rows = prompts(tmp_path / "prompts.jsonl", 32)
    _, rollout = run_rollout(launch(tmp_path / "prompts.jsonl", checkpoint, 32, group_rm), router)
    output = rollout()
    groups = output.samples
    assert len(groups) == 32 and all(len(group) == 4 for group in groups)
    for n, group in enumerate(groups):
        assert [sample.prompt for sample in group] == [rows[n]["prompt"]] * 4
        assert [sample.reward for sample in group] == [expected_reward(rows[n]["prompt"])] * 4, n
        assert all(type(sample.reward) is float for sample in group)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("group_rm", [True, False], ids=["group-rm", "per-sample"])
def test_a_failing_group_fails_the_rollout_and_no_other_group(configured: str, group_rm: bool, router: str,
                                                              checkpoint: Path, tmp_path: Path) -> None:
    """slime ends the rollout on the failed group's error (naming its sample), never a number; the 31 other
    groups, their reward calls gathered with it, each get their own rewards (finding 6)."""
    bad = 13
    rows = prompts(tmp_path / "prompts.jsonl", 32, bad=bad)
    source, rollout = run_rollout(launch(tmp_path / "prompts.jsonl", checkpoint, 32, group_rm), router)
    with pytest.raises(engine.VerificationError) as info:
        rollout()
    assert info.value.environment == "faulty"
    assert info.value.item_id in {sample.index for sample in source.handed[bad]}  # its own sample, named
    good = [group for n, group in enumerate(source.handed) if n != bad]

    def all_scored() -> bool:
        return all(sample.reward is not None for group in good for sample in group)

    wait_until(all_scored, 60, "the other groups were never scored")
    for group in good:
        row = rows[group[0].group_index]
        assert [sample.reward for sample in group] == [expected_reward(row["prompt"])] * 4
    assert all(sample.reward is None for sample in source.handed[bad])  # never a number


def test_the_example_launch_is_slimes(tmp_path: Path, router: str) -> None:
    """The example's launch line parses with slime's own arguments, and slime requires --rollout-batch-size."""
    line = slime_grpo.slime_args(tmp_path / "p.jsonl")
    args = parse(line, router)
    assert (args.custom_rm_path, args.group_rm, args.rollout_batch_size) == ("engine.adapters.slime.custom_rm", True, 8)
    assert (args.input_key, args.label_key, args.metadata_key) == ("prompt", "label", "metadata")
    without = [arg for n, arg in enumerate(line) if "--rollout-batch-size" not in line[max(n - 1, 0):n + 1]]
    with pytest.raises(SystemExit):
        slime_parser().parse_known_args(without)


def test_the_example_prompts_keep_each_rollouts_environment(tmp_path: Path, router: str, checkpoint: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """slime's own data source over the example's prompt file: each sample's item is its rollout's
    environment and task (three environments, none defaulted to arithmetic)."""
    monkeypatch.delenv("ENGINE_ENVIRONMENT", raising=False)
    count = slime_grpo.write_prompts(ROOT / "examples" / "rollouts.jsonl", tmp_path / "p.jsonl")
    line = slime_grpo.slime_args(tmp_path / "p.jsonl")
    line[line.index("--hf-checkpoint") + 1] = str(checkpoint)
    args = parse(line, router)
    args.rollout_shuffle = False
    samples = RolloutDataSourceWithBuffer(args).dataset.samples
    source = [json.loads(row) for row in (ROOT / "examples" / "rollouts.jsonl").read_text().splitlines()]
    assert len(samples) == count == len(source)
    for sample, row in zip(samples, source, strict=True):
        made = item(sample)
        assert (made["environment"], made["task"]) == (row["environment"], row["task"])
    assert {item(sample)["environment"] for sample in samples} == {"arithmetic", "keywords", "math"}


def doc_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.S)


def test_the_pages_launch_line_is_slimes(router: str) -> None:
    (block,) = doc_blocks("bash")
    words = shlex.split(block.replace("\\\n", " "))
    assert words[:4] == ["ENGINE_CONFIG=/path/to/engine.toml", "python", "train.py", "${MODEL_ARGS[@]}"]
    args = parse(words[4:], router)
    assert (args.custom_rm_path, args.metadata_key, args.label_key) == ("engine.adapters.slime.custom_rm", "metadata",
                                                                        "label")


def test_the_pages_prompt_row_is_read_as_it_says(tmp_path: Path, router: str, checkpoint: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINE_ENVIRONMENT", raising=False)
    (row,) = doc_blocks("json")
    (tmp_path / "p.jsonl").write_text(json.dumps(json.loads(row)) + "\n")
    (block,) = doc_blocks("bash")
    words = shlex.split(block.replace("\\\n", " "))[4:]
    words[words.index("--prompt-data") + 1] = str(tmp_path / "p.jsonl")
    words[words.index("--hf-checkpoint") + 1] = str(checkpoint)
    (sample,) = RolloutDataSourceWithBuffer(parse(words, router)).dataset.samples
    assert item(sample) == {"environment": "arithmetic", "task": {"prompt": "What is 50 - 18?", "reference": "32"},
                            "trajectory": "", } | ({"id": sample.index} if sample.index is not None else {})
