"""Exact-match arithmetic verifier: 1.0 when the last number in the answer equals the reference."""

import re

from .text import answer_text

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(task, trajectory):
    numbers = NUMBER.findall(answer_text(trajectory).replace(",", ""))
    if not numbers:
        return 0.0
    return 1.0 if float(numbers[-1]) == float(task["reference"]) else 0.0
