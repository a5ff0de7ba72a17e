"""What the OpenRLHF tests share: OpenRLHF 0.11.2's own code, unmodified, around the one part that needs a GPU.

OpenRLHF scores a sample in its rollout actor (``RolloutRayActor``, one per vLLM engine): its
``generate_responses`` runs ``SingleTurnAgentExecutor.execute`` once per sample, concurrently on the actor's
event loop, and the executor generates, then calls the reward (a ``.py`` file's ``reward_func`` through
``asyncio.to_thread``, or an HTTP ``remote_url`` with its own retries). ``Rollout`` below is that actor
class with only its ``__init__`` replaced: instead of building vLLM's engine it keeps a ``Scripted`` one,
which answers each prompt with the response the test wrote for it. Everything else (``generate``,
``generate_responses``, the executor, the sample generator that dispatches prompts to the actors and turns
their answers into ``Experience``\\ s, the experience maker that concatenates and shapes them) is OpenRLHF's.

The tokenizer is built in code (nothing can be downloaded): byte-level, no merges, so a prompt decodes to
exactly its text, as a real tokenizer's prompt does in OpenRLHF's query (``decode(prompt + response)``).
"""

from __future__ import annotations

import asyncio
import runpy
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
from openrlhf.trainer.ray.vllm_engine import RolloutRayActor
from openrlhf.utils.agent import SingleTurnAgentExecutor
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOS = "<|eos|>"


def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with no merges: every text round-trips through encode and decode exactly."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    vocab[EOS] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, pad_token=EOS)


class Scripted:
    """The stand-in for vLLM's ``AsyncLLMEngine`` in ``RolloutRayActor``: each prompt gets the response the
    test wrote for it (``responses``: prompt text -> response text), as one finished request output."""

    def __init__(self, responses: dict[str, str], hf_tokenizer: PreTrainedTokenizerFast) -> None:
        self.responses = responses
        self.tokenizer = hf_tokenizer
        self.output_processor = SimpleNamespace(get_num_unfinished_requests=lambda: 0)  # the generator reads it

    async def generate(self, prompt: dict[str, Any], sampling_params: Any, request_id: str) -> AsyncIterator[Any]:
        text = self.tokenizer.decode(prompt["prompt_token_ids"], skip_special_tokens=False)
        response = self.responses[text]
        token_ids = self.tokenizer(text=response, add_special_tokens=False)["input_ids"]
        await asyncio.sleep(0)  # a real engine answers later, never within the call
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=token_ids, text=response, finish_reason="stop",
                                                       logprobs=None)])


class Rollout(RolloutRayActor.__ray_actor_class__):  # type: ignore[name-defined,misc]
    """OpenRLHF's rollout actor with ``Scripted`` in place of vLLM (its ``__init__`` is the only part replaced)."""

    def __init__(self, remote_rm_url: Sequence[str], responses: dict[str, str],
                 hf_tokenizer: PreTrainedTokenizerFast) -> None:
        # What RolloutRayActor.__init__ does without agent_func_path, less building vLLM's engine
        self.executor = SingleTurnAgentExecutor(list(remote_rm_url))
        self.llm = Scripted(responses, hf_tokenizer)
        self._mm_pad_token_ids = None

    def engine_batches(self) -> int:
        """The engine batches this process's adapter scored (the coalescers' count); 0 before any."""
        from engine.adapters import _runtime

        return sum(c.batches for entry in _runtime._ENTRIES.values() for c in entry.coalescers.values())


class _Parsed(Exception):
    def __init__(self, args: Any) -> None:
        self.parsed = args


def parse_launch(argv: Sequence[str]) -> Any:
    """OpenRLHF's own ``train_ppo_ray`` command line parsed and validated, as ``python -m`` runs it, stopped
    where training would start (its ``get_strategy``, the first call that builds anything): the arguments
    it would train with (OpenRLHF's nested namespace). A rejected line exits as argparse exits (2)."""
    import openrlhf.utils
    import ray

    saved = openrlhf.utils.get_strategy, ray.is_initialized, sys.argv

    def stop(args: Any) -> Any:
        raise _Parsed(args)

    openrlhf.utils.get_strategy = stop  # the module binds it by name when runpy runs it
    ray.is_initialized = lambda: True  # train()'s first line would start a Ray cluster of its own
    sys.argv = ["train_ppo_ray", *argv]
    try:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=False)
    except _Parsed as parsed:
        return parsed.parsed
    finally:
        openrlhf.utils.get_strategy, ray.is_initialized, sys.argv = saved
    raise AssertionError("train_ppo_ray returned without starting to train")


def strategy(args: Any) -> Any:
    """What OpenRLHF's dataset and sample generator read of its DeepSpeed strategy (args, rank 0, print)."""
    return SimpleNamespace(args=args, is_rank_0=lambda: True, print=lambda *a, **k: None)


def prompts_dataset(args: Any, hf_tokenizer: PreTrainedTokenizerFast) -> Any:
    """The prompt dataset OpenRLHF's trainer builds from ``args`` (its ``blending_datasets`` and
    ``PromptDataset``: the ``--data.input_key`` and ``--data.label_key`` columns of each row)."""
    from openrlhf.datasets import PromptDataset
    from openrlhf.datasets.utils import blending_datasets

    train_data = blending_datasets(args.data.prompt_dataset, args.data.prompt_probs, strategy(args), args.train.seed,
                                   max_count=args.data.max_samples, dataset_split=args.data.prompt_split)
    train_data = train_data.select(range(min(args.data.max_samples, len(train_data))))
    return PromptDataset(train_data, hf_tokenizer, strategy(args), input_template=args.data.input_template)


def batches_of(dataset: Any) -> Any:
    """An iterator of the dataset's prompts one row at a time, as OpenRLHF's dataloader yields them."""
    for index in range(len(dataset)):
        yield dataset.collate_fn([dataset[index]])


def write_prompts(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    """A JSONL prompt dataset, one row per line."""
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return path


def generate(args: Any, engines: Sequence[Any], dataset: Any, hf_tokenizer: PreTrainedTokenizerFast) -> list[Any]:
    """OpenRLHF's ``SamplesGenerator`` over ``dataset``: every prompt dispatched to the rollout actors
    ``engines`` (Ray actors of ``Rollout``), their answers turned into ``Experience``\\ s (in the order they
    finished, as OpenRLHF collects them)."""
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    generator = SamplesGenerator(strategy(args), None, None, hf_tokenizer, list(engines))
    experiences, _, _ = generator._generate_vllm(
        batches_of(dataset), len(dataset), False, n_samples_per_prompt=args.rollout.n_samples_per_prompt,
        max_new_tokens=args.rollout.max_new_tokens, max_len=args.data.max_len,
    )
    return list(experiences)


def experience_maker(args: Any, hf_tokenizer: PreTrainedTokenizerFast) -> Any:
    """OpenRLHF's ``RemoteExperienceMaker`` with no model groups: its reward shaping needs none."""
    from openrlhf.models.utils import compute_approx_kl  # noqa: F401  (imported by the maker: fail here if not)
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    return RemoteExperienceMaker(None, None, None, None, FixedKLController(args.algo.kl.init_coef), strategy(args),
                                 hf_tokenizer)
