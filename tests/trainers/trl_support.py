"""What the TRL tests share: a tiny causal LM and its tokenizer, built in code and saved where TRL loads a
model from (nothing comes from a hub), and a GRPO configuration sized for a CPU and a few seconds a step."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# every word the prompts and the model's completions use: digits, the prompts' words, and chat markers
WORDS = [str(n) for n in range(40)] + ["What", "is", "+", "?", "End", "with", "the", "number.", "Count", "up"]
SPECIAL = ["<unk>", "<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tiny_model(directory: Path, *, chat_template: str | None = None) -> Path:
    """A one-layer Llama of a few thousand parameters and a word-level tokenizer over :data:`WORDS`, saved in
    ``directory`` (``from_pretrained`` reads it as it reads a hub model's). ``chat_template``: the tokenizer's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        padding_side="left",  # TRL's GRPOTrainer requires it
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        pad_token_id=vocab["<pad>"],
        eos_token_id=vocab["<|endoftext|>"],
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def offline() -> None:
    """Nothing from a hub, and no telemetry: set before transformers or TRL is imported."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"


def grpo_args(output_dir: Path, **overrides: Any) -> Any:
    """A ``GRPOConfig`` for two CPU steps of 4 completions (2 prompts x 2 generations) a step, 4 tokens each."""
    from trl import GRPOConfig

    settings: dict[str, Any] = {
        "output_dir": str(output_dir),
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 4,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "use_vllm": False,
        "seed": 7,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    settings.update(overrides)
    return GRPOConfig(**settings)


ROW_PLUGIN = '''\
"""Reward = the task's row + a digest of the completion's text / 1000: each reward says which row and which
completion it is for. A task with "fail" raises. Each call is appended to $ENGINE_TEST_ROW_LOG as JSON."""

import json
import os
import threading

_lock = threading.Lock()


def text(trajectory):
    if isinstance(trajectory, str):
        return trajectory
    return " ".join(str(m.get("content") or "") for m in trajectory if m.get("role") == "assistant")


def score(task, trajectory):
    said = text(trajectory)
    if task.get("fail"):
        raise ArithmeticError(f"row {task['row']} fails on purpose")
    reward = task["row"] + (sum(map(ord, said)) % 1000) / 1000
    log = os.environ.get("ENGINE_TEST_ROW_LOG")
    if log:
        with _lock, open(log, "a") as f:
            f.write(json.dumps({"row": task["row"], "prompt": task["prompt"], "said": said, "reward": reward,
                                "task": sorted(task)}) + "\\n")
    return reward
'''


def add_row_env(envs: Path, name: str = "rowcode") -> str:
    """The environment whose rewards encode their row and completion (:data:`ROW_PLUGIN`)."""
    directory = envs / name
    directory.mkdir(parents=True)
    (directory / "verify.py").write_text(ROW_PLUGIN)
    manifest = '{"kind": "environment", "verifier": {"kind": "plugin", "ref": "verify:score"}}'
    (directory / "manifest.json").write_text(manifest)
    return name


def completion_text(completion: Any) -> str:
    """What :data:`ROW_PLUGIN` reads of a completion (text, or the assistant messages' contents)."""
    if isinstance(completion, str):
        return completion
    return " ".join(str(m.get("content") or "") for m in completion if m.get("role") == "assistant")


def expected_reward(row: int, completion: Any) -> float:
    """The reward :data:`ROW_PLUGIN` gives ``row``'s ``completion``, as TRL keeps it (float32)."""
    import torch

    value = row + (sum(map(ord, completion_text(completion))) % 1000) / 1000
    return float(torch.tensor(value, dtype=torch.float32).item())


def prompt_of(row: int) -> str:
    return f"Count up {row}"


def row_of(prompt: Any) -> int:
    """The row a prompt (text or messages) was made for (:func:`prompt_of`)."""
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    return int(text.split()[2])


class Recorder:
    """A ``TrainerCallback`` keeping what TRL itself kept of each step (``GRPOTrainer._logs``: the rows it
    gathered from every rank, the rewards it received from each reward function, its advantages)."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.steps: list[dict[str, Any]] = []

    def callback(self) -> Any:
        from transformers import TrainerCallback

        recorder = self

        class Record(TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                logs = recorder.trainer._logs
                recorder.steps.append({
                    "prompts": list(logs["prompt"]),
                    "completions": list(logs["completion"]),
                    "rewards": {name: list(values) for name, values in logs["rewards"].items()},
                    "advantages": list(logs["advantages"]),
                })

        return Record()


def trainer_for(
    model: Path,
    reward_funcs: list[Any],
    rows: list[dict[str, Any]],
    output_dir: Path,
    **kwargs: Any,
) -> tuple[Any, Recorder]:
    """``GRPOTrainer(model=<its directory>, ...)`` over ``rows`` (in order: no shuffling), and the recorder
    of its steps. ``kwargs``: ``GRPOConfig`` settings, and ``environment_factory``."""
    from datasets import Dataset
    from trl import GRPOTrainer

    factory = kwargs.pop("environment_factory", None)
    recorder = Recorder()
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=reward_funcs,
        args=grpo_args(output_dir, shuffle_dataset=False, **kwargs),
        train_dataset=Dataset.from_list(rows),
        callbacks=[recorder.callback()],
        environment_factory=factory,
    )
    recorder.trainer = trainer
    return trainer, recorder


def free_port() -> int:
    """A port of 127.0.0.1 nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def main(spec_path: str) -> None:
    """One rank of a ``torchrun`` run (``torchrun --nproc_per_node 2 trl_support.py SPEC``): train as ``SPEC``
    (JSON: ``model``, ``reward`` (EngineReward's arguments), ``rows``, ``output_dir``, ``result``) says, and
    write what this rank's trainer kept, or the error that ended it, to ``<result>.<rank>``."""
    import json

    offline()
    from engine import VerificationError
    from engine.adapters.trl import EngineReward

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    reward = EngineReward(**spec["reward"])
    trainer, recorder = trainer_for(Path(spec["model"]), [reward], spec["rows"], Path(spec["output_dir"]))
    outcome: dict[str, Any] = {"error": None}
    try:
        trainer.train()
    except VerificationError as exc:
        outcome = {"error": type(exc).__name__, "environment": exc.environment, "index": exc.index, "text": str(exc)}
        raise
    finally:
        result = {
            "rank": rank,
            "world_size": int(os.environ["WORLD_SIZE"]),
            "outcome": outcome,
            "global_step": trainer.state.global_step,
            "log_history": trainer.state.log_history,
            "steps": recorder.steps,
        }
        Path(f"{spec['result']}.{rank}").write_text(json.dumps(result))


if __name__ == "__main__":
    import sys

    main(sys.argv[1])
