"""What the verl tests and benchmark share: a tiny tokenizer and model config built in code, verl's config
composed by its own hydra files, generation's stand-in, and prompts batched as verl's dataset batches them.

Nothing here replaces verl's reward code: the tests run ``RewardLoopManager``, ``RewardLoopWorker`` (as
verl's Ray actors), ``NaiveRewardManager`` and ``AgentLoopWorker`` as verl 0.9.1 ships them. The one
stand-in is :class:`CannedAgentLoop`, an agent loop (verl's own extension point, registered through
``actor_rollout_ref.rollout.agent.agent_loop_config_path``) that answers each prompt with the response
its row names instead of asking an LLM server: there is no GPU nor model here.
"""

from __future__ import annotations

import os
import shutil
import textwrap
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

# a one-machine cluster: a Ray started here keeps to 127.0.0.1 (read as ray is imported; tests/conftest.py
# sets it for the tests, the benchmark imports this first)
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray
import torch
import verl
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from verl import DataProto

with warnings.catch_warnings():
    # verl 0.9.1 imports Ray's state API from its old place (ray.experimental.state), which warns
    warnings.filterwarnings("ignore", "Ray state API is no longer experimental", DeprecationWarning)
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopBase,
        AgentLoopMetrics,
        AgentLoopOutput,
        AgentLoopWorker,
        get_trajectory_info,
    )
    from verl.experimental.reward_loop import RewardLoopManager, RewardLoopWorker
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
from verl.utils.dataset.rl_dataset import collate_fn

import engine
import engine.adapters.verl

# verl's, imported here (where the warning one of them gives is filtered) for the tests
__all__ = ["AgentLoopWorker", "NaiveRewardManager", "RewardLoopManager", "RewardLoopWorker", "get_trajectory_info"]

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
ENGINE_ROOT = Path(engine.__file__).resolve().parents[1]  # the checkout whose engine runs (the workers' too)
ADAPTER = engine.adapters.verl.__file__  # what reward.custom_reward_function.path names
VERL_CONFIG = Path(verl.__file__).parent / "trainer" / "config"
CANNED = "engine_canned"  # the stand-in agent loop's name in verl's registry
EOS, PAD = "<|endoftext|>", "<|pad|>"
# The tokenizer's training text: every character the prompts and responses use, so that decoding what it
# encoded gives the same text back (the rewards depend on it)
CORPUS = [
    "What is 12 * 34? End with the number. 0123456789 -+*/=.,:;!?'\"()[]{}<>_#@%&|~^$`\\",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]
# The environment whose reward says which sample it scored: the response's number, plus 1 when it is the
# reference, and it checks the task verl built (``num_turns`` from verl's rollout, ``index`` from the row)
SAMPLE = """\
def score(task, trajectory):
    if task["num_turns"] != 2 or not isinstance(task["index"], int) or task["rollout_reward_scores"] != {}:
        raise ValueError(f"not the task verl built: {task!r}")
    return int(trajectory) / 1000 + (1.0 if trajectory == task["reference"] else 0.0)
"""


def workspace(root: Path) -> Path:
    """``root`` with a copy of tests/envs (those an ``engine serve`` starts with) and the ``sample`` environment, an
    engine config over them (``engine.toml``, returned), a tiny model and verl's agent loop file."""
    from test_serve import CANNOT_SCORE

    envs = root / "envs"
    shutil.copytree(TESTS / "envs", envs, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", *CANNOT_SCORE))
    (envs / "sample").mkdir()
    (envs / "sample" / "manifest.json").write_text(
        '{"kind": "environment", "verifier": {"kind": "plugin", "ref": "verify:score"}}'
    )
    (envs / "sample" / "verify.py").write_text(SAMPLE)
    config = root / "engine.toml"
    config.write_text(f'environments = "{envs}"\nallow_unpinned = true\n')
    tiny_model(root)
    agent_loop_file(root)
    return config


def tiny_model(root: Path) -> Path:
    """A directory verl loads as its model: a byte-level BPE tokenizer trained here on :data:`CORPUS`, and the
    ``config.json`` of a 1-layer Qwen2 (no weights: neither the reward path nor the stand-in loads them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    path = root / "tiny-model"
    if (path / "config.json").exists():
        return path
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOS, PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD)
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    fast.save_pretrained(path)
    Qwen2Config(
        vocab_size=len(fast), hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, architectures=["Qwen2ForCausalLM"], eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    ).save_pretrained(path)
    return path


def agent_loop_file(root: Path) -> Path:
    """The file ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` names: verl's way to register an
    agent loop in every ``AgentLoopWorker`` (each reads it as it starts)."""
    path = root / "agent_loops.yaml"
    path.write_text(f"- name: {CANNED}\n  _target_: verl_support.CannedAgentLoop\n")
    return path


def compose_verl(overrides: Sequence[str] = (), *, config_dir: Path = VERL_CONFIG, name: str = "ppo_trainer") -> Any:
    """verl's trainer config as ``python -m verl.trainer.main_ppo [--config-path DIR --config-name NAME]
    OVERRIDES`` composes it: hydra, over the YAML files verl ships (or a user's file built on them)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


def user_config(directory: Path, snippet: str, name: str = "engine_ppo") -> Path:
    """A user's config file as verl's recipes write one: verl's ``ppo_trainer`` first, then ``snippet``
    (YAML) over it; ``--config-path directory --config-name name`` launches it."""
    directory.mkdir(parents=True, exist_ok=True)
    header = f"hydra:\n  searchpath:\n    - file://{VERL_CONFIG}\ndefaults:\n  - ppo_trainer\n  - _self_\n"
    (directory / f"{name}.yaml").write_text(header + textwrap.dedent(snippet))
    return directory / f"{name}.yaml"


def settings(root: Path, workers: int) -> list[str]:
    """What the tests set besides the reward's function: the tiny model, the stand-in agent loop (one
    agent-loop worker), short prompts and responses, and ``workers`` reward workers."""
    return [
        f"actor_rollout_ref.model.path={root / 'tiny-model'}",
        "actor_rollout_ref.rollout.name=vllm",  # a name the rollout config insists on; no vLLM is started
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={root / 'agent_loops.yaml'}",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={CANNED}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.prompt_length=64",
        "actor_rollout_ref.rollout.response_length=32",
        f"reward.num_workers={workers}",
    ]


def engine_reward(**reward_kwargs: str) -> list[str]:
    """The launch line's reward part, as docs/trainers/verl.md writes it."""
    return [
        f"reward.custom_reward_function.path={ADAPTER}",
        "reward.custom_reward_function.name=compute_score",
        *(f"+reward.custom_reward_function.reward_kwargs.{key}={value}" for key, value in reward_kwargs.items()),
    ]


def start_ray() -> None:
    """A local Ray of 2 CPUs on 127.0.0.1, its workers running this checkout's engine and these helpers."""
    paths = [str(ENGINE_ROOT), str(TESTS), str(HERE)]
    env = {"PYTHONPATH": os.pathsep.join(paths), "TOKENIZERS_PARALLELISM": "false"}
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env},
             log_to_driver=False)


def rows(samples: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Dataset rows as ``examples/trainers/verl_ppo.py`` writes them (``data_source``, ``prompt`` messages,
    ``reward_model.ground_truth``, ``extra_info``), and the stand-in's ``response``."""
    return [
        {
            "data_source": sample["data_source"],
            "prompt": [{"role": "user", "content": sample.get("question", f"question {n}")}],
            "reward_model": {"style": "rule", "ground_truth": sample["ground_truth"]},
            "extra_info": {"index": n, **sample.get("extra_info", {})},
            "response": sample["response"],
        }
        for n, sample in enumerate(samples)
    ]


def numbered(count: int, *, environment: str = "sample", wrong: int = 3) -> list[dict[str, Any]]:
    """``count`` samples whose rewards all differ: sample ``n`` answers ``n``, right unless ``n % wrong == 0``."""
    return [
        {"data_source": environment, "question": f"What is {n} + 0?", "response": str(n),
         "ground_truth": str(n if n % wrong else n + 1)}
        for n in range(count)
    ]


def expected(samples: Sequence[Mapping[str, Any]]) -> list[float]:
    """The ``sample`` environment's rewards of ``samples``."""
    return [int(s["response"]) / 1000 + (1.0 if s["response"] == s["ground_truth"] else 0.0) for s in samples]


def float32(rewards: Sequence[float]) -> list[float]:
    """``rewards`` as verl's ``rm_scores`` (a float32 tensor) holds them."""
    return [float(value) for value in torch.tensor(rewards, dtype=torch.float32)]


def gen_batch(rows_: Sequence[Mapping[str, Any]]) -> DataProto:
    """The batch verl's trainer hands its rollout: each row as ``RLHFDataset`` returns it (``raw_prompt``,
    ``index`` from ``extra_info``, the row's other columns), collated by verl's own ``collate_fn``."""
    items = []
    for row in rows_:
        item = {key: value for key, value in row.items() if key != "prompt"}
        item["extra_info"] = dict(row["extra_info"])
        item["raw_prompt"] = list(row["prompt"])
        item["index"] = row["extra_info"]["index"]
        item["dummy_tensor"] = torch.tensor([0], dtype=torch.uint8)
        items.append(item)
    return DataProto.from_single_dict(collate_fn(items))


def rewards_of(output: DataProto) -> list[float]:
    """Each sample's reward from a batch's ``rm_scores`` (verl writes it on the last valid response token)."""
    scores = output.batch["rm_scores"]
    prompt_length = output.batch["prompts"].shape[1]
    valid = output.batch["attention_mask"][:, prompt_length:].sum(dim=1)
    return [float(scores[i, int(valid[i]) - 1]) for i in range(scores.shape[0])]


def coalesced_batches(_worker: Any = None) -> int:
    """Engine batches the adapter's coalescers have made in this process, every loop's (run in a reward
    worker through Ray's ``__ray_call__``, which passes the actor)."""
    from engine.adapters import _runtime

    return sum(c.batches for entry in list(_runtime._ENTRIES.values()) for c in entry.coalescers.values())


def worker_batches(handles: Sequence[Any]) -> list[int]:
    """:func:`coalesced_batches` of each reward worker (a Ray actor)."""
    return list(ray.get([handle.__ray_call__.remote(coalesced_batches) for handle in handles]))


class CannedAgentLoop(AgentLoopBase):
    """Generation's stand-in: the row's ``response`` tokenized (and EOS), as a single-turn loop returns the
    model's tokens; everything after it (padding, the reward call, assembling ``rm_scores``) is verl's."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        prompt = "".join(str(message["content"]) for message in kwargs["raw_prompt"])
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        response_ids = [*self.tokenizer.encode(str(kwargs["response"]), add_special_tokens=False),
                        self.tokenizer.eos_token_id]
        return AgentLoopOutput(
            prompt_ids=prompt_ids, response_ids=response_ids, response_mask=[1] * len(response_ids),
            num_turns=2, metrics=AgentLoopMetrics(),  # 2, as verl's single-turn loop counts a prompt and answer
        )
