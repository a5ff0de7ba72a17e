"""Writes the example rollouts (deterministic): ``python examples/make_rollouts.py``.

rollouts.jsonl: 240 arithmetic rows (plugin), 120 keyword rows (endpoint) and 60 math rows (a plugin on
math-verify, in worker processes), in varied trajectory shapes, about a third of the answers wrong.
rubric_rollouts.jsonl: 24 helpfulness rows, for a judge.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
TOPICS = [
    ("photosynthesis", ["light", "chlorophyll", "glucose", "oxygen"]),
    ("the water cycle", ["evaporation", "condensation", "precipitation", "runoff"]),
    ("TCP", ["handshake", "acknowledgement", "retransmission", "ordering"]),
    ("vaccines", ["antigen", "immune", "antibodies", "memory"]),
    ("inflation", ["prices", "purchasing power", "interest rates", "money supply"]),
]


def arithmetic(rng: random.Random, n: int) -> dict[str, Any]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*"])
    truth = {"+": a + b, "-": a - b, "*": a * b}[op]
    answer = truth if rng.random() < 0.65 else truth + rng.choice([-10, -1, 1, 2, 7])
    prompt = f"What is {a} {op} {b}?"
    text = f"Let me compute {a} {op} {b}. The answer is {answer}."
    shape = n % 3
    trajectory: Any
    if shape == 0:
        trajectory = text
    elif shape == 1:
        trajectory = [{"role": "user", "content": prompt}, {"role": "assistant", "content": text}]
    else:
        trajectory = {"role": "assistant", "content": text}
    return {"id": f"arith-{n:04d}", "environment": "arithmetic",
            "task": {"prompt": prompt, "reference": str(truth)}, "trajectory": trajectory}


def keywords(rng: random.Random, n: int) -> dict[str, Any]:
    topic, words = rng.choice(TOPICS)
    mentioned = rng.sample(words, rng.randint(1, len(words)))
    text = f"A short summary of {topic}: it involves " + ", ".join(mentioned) + "."
    trajectory = [{"role": "assistant", "content": [{"type": "text", "text": text}]}] if n % 2 else text
    return {"id": f"kw-{n:04d}", "environment": "keywords",
            "task": {"prompt": f"Summarise {topic} in two sentences.", "keywords": words}, "trajectory": trajectory}


FRACTIONS = [(1, 2), (1, 3), (2, 3), (3, 4), (1, 4), (2, 5), (3, 5), (5, 6), (1, 8), (7, 8)]


def math(rng: random.Random, n: int) -> dict[str, Any]:
    """A sum of two fractions; the answer boxed, inline or as a decimal, and wrong about a third of the time."""
    (a, b), (c, d) = rng.sample(FRACTIONS, 2)
    truth = Fraction(a, b) + Fraction(c, d)
    said = truth if rng.random() < 0.65 else truth + Fraction(rng.choice([-1, 1]), rng.choice([2, 4, 12]))
    written = [
        f"$\\boxed{{\\frac{{{said.numerator}}}{{{said.denominator}}}}}$",
        f"\\boxed{{{said.numerator}/{said.denominator}}}",
        f"${said.numerator}/{said.denominator}$" if said.denominator != 1 else f"${said.numerator}$",
    ][n % 3]
    if said.denominator in (2, 4, 5, 8) and n % 4 == 0:  # a terminating decimal, said as one
        written = f"${float(said):g}$"
    text = f"Adding {a}/{b} and {c}/{d} over a common denominator, the sum is {written}."
    trajectory: Any = text if n % 2 else [{"role": "assistant", "content": text}]
    gold = f"$\\frac{{{truth.numerator}}}{{{truth.denominator}}}$" if truth.denominator != 1 else f"${truth.numerator}$"
    return {"id": f"math-{n:04d}", "environment": "math",
            "task": {"prompt": f"What is {a}/{b} + {c}/{d}?", "answer": gold}, "trajectory": trajectory}


def helpfulness(rng: random.Random, n: int) -> dict[str, Any]:
    topic, words = TOPICS[n % len(TOPICS)]
    good = rng.random() < 0.5
    text = (f"{topic.capitalize()} works through {', '.join(words)}; each step feeds the next."
            if good else f"I am not sure what {topic} is.")
    return {"id": f"help-{n:04d}", "environment": "helpfulness",
            "task": {"prompt": f"Explain {topic} to a curious teenager.",
                     "reference": f"An accurate explanation of {topic} mentioning {', '.join(words)}."},
            "trajectory": [{"role": "assistant", "content": text}]}


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {path}")


def main() -> None:
    rng = random.Random(20261130)
    rows = [arithmetic(rng, i) for i in range(240)] + [keywords(rng, i) for i in range(120)]
    rng.shuffle(rows)
    # the math rows have a generator of their own, so the other rows (and rubric_rollouts.jsonl) stay as they were
    math_rng = random.Random(20261201)
    for i in range(60):
        rows.insert(i * 7 + 3, math(math_rng, i))
    write(HERE / "rollouts.jsonl", rows)
    write(HERE / "rubric_rollouts.jsonl", [helpfulness(rng, i) for i in range(24)])


if __name__ == "__main__":
    main()
