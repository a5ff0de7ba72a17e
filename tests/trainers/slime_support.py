"""slime 0.3.1 (source at 624b824, on PYTHONPATH) run for tests/trainers/test_slime.py: its argument provider,
its data source over a prompt file, and its ``generate_rollout`` with a stand-in generate function.

``generate`` stands in for SGLang (``--custom-generate-function-path``, slime's own hook for a custom
generator): it answers each arithmetic prompt, right about sums and products and one off about
differences, as a model's reply. The router that slime asks for its workers when the rollout ends
(``GET /workers``) is a real HTTP server on 127.0.0.1 with none.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STANDINS = Path(__file__).resolve().parent / "standins" / "slime"  # import-only SGLang stand-ins: see its README.md
QUESTION = re.compile(r"What is (\d+) ([+*-]) (\d+)\?")

# What slime's parse_args takes from parsers the suite cannot run (SGLang's, and Megatron-LM's, neither
# installed): the router's address, SGLang's concurrency and data-parallel size, one rollout engine.
NOT_FROM_SLIMES_PROVIDER = {"sglang_router_port": 0, "sglang_server_concurrency": 64, "sglang_dp_size": 1,
                            "rollout_num_engines": 1}


def slime_parser() -> argparse.ArgumentParser:
    """slime's own arguments (``get_slime_extra_args_provider`` and ``_pre_parse_mode``'s) on one parser:
    what ``slime.utils.arguments.parse_args`` hands Megatron-LM's parser to add to its own."""
    if str(STANDINS) not in sys.path:
        sys.path.insert(0, str(STANDINS))
    arguments = importlib.import_module("slime.utils.arguments")
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    arguments.get_slime_extra_args_provider()(parser)
    parser.add_argument("--train-backend", type=str, choices=["megatron"], default="megatron")
    parser.add_argument("--debug-rollout-only", action="store_true", default=False)
    parser.add_argument("--debug-train-only", action="store_true", default=False)
    parser.add_argument("--load-debug-rollout-data", type=str, default=None)
    return parser


def parse(line: Sequence[str], router: str) -> argparse.Namespace:
    """``line`` parsed by slime's own arguments (every argument known to them), completed as its
    ``parse_args`` completes it (``over_sampling_batch_size``), plus what SGLang's parser would add."""
    args, unknown = slime_parser().parse_known_args(list(line))
    assert unknown == [], f"not slime's arguments: {unknown}"
    missing = [name for name in NOT_FROM_SLIMES_PROVIDER if hasattr(args, name)]
    assert missing == [], f"slime's provider has {missing} now: take them from it"
    for name, value in NOT_FROM_SLIMES_PROVIDER.items():
        setattr(args, name, value)
    host, _, port = router.removeprefix("http://").partition(":")
    args.sglang_router_ip, args.sglang_router_port = host, int(port)
    if args.over_sampling_batch_size is None:  # slime_validate_args' default (arguments.py: 1985)
        args.over_sampling_batch_size = args.rollout_batch_size
    return args


def tiny_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer built in code and saved where ``--hf-checkpoint`` points (nothing from a hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[PAD]", "What", "is", "?", "+", "-", "*", "The", "answer", ".", *map(str, range(200))]
    tokenizer = Tokenizer(models.WordLevel({word: n for n, word in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(directory)
    return directory


def reply_to(prompt: str) -> str:
    found = QUESTION.search(prompt)
    if found is None:
        return "I do not know."
    a, op, b = int(found[1]), found[2], int(found[3])
    value = a + b if op == "+" else a * b if op == "*" else a - b + 1
    return f"The answer is {value} ."


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """``--custom-generate-function-path``: the sample's response, as slime's own ``generate`` leaves it."""
    from slime.utils.types import Sample

    text = reply_to(str(sample.prompt))
    tokens = list(range(2, 2 + len(text.split())))
    sample.tokens = list(sample.tokens or [1]) + tokens
    sample.response = (sample.response or "") + text
    sample.response_length += len(tokens)
    sample.rollout_log_probs = [0.0] * sample.response_length
    sample.loss_mask = [1] * sample.response_length
    sample.status = Sample.Status.COMPLETED
    return sample


def truth(prompt: str) -> str:
    found = QUESTION.search(prompt)
    assert found is not None, prompt
    a, op, b = int(found[1]), found[2], int(found[3])
    return str(a + b if op == "+" else a * b if op == "*" else a - b)


def fresh_state() -> None:
    """slime keeps its generation state in a singleton: each rollout of the suite starts without one."""
    from slime.rollout.sglang_rollout import GenerateState

    GenerateState.clear_instances()
