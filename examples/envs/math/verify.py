"""math-verify as a plugin: the answer in the trajectory against the task's reference ``answer``.

math-verify bounds its parsing and comparison with ``signal.alarm``, and when that alarm fires it
returns "no match": a 0.0 the engine cannot tell from a wrong answer. Both timeouts are turned off
here (``parsing_timeout=None``, ``timeout_seconds=None``) and the engine's ``timeout`` bounds the
whole call instead: an item that takes too long is an error, never a zero. A thread cannot be
stopped, so the manifest asks for worker processes (``"executor": "process"``): a call past its
timeout has its worker killed, and sympy's CPU-bound work uses every core.
"""

import logging

from math_verify import parse, verify

# math-verify warns, once per process, that its timeouts are off: here they are, on purpose (above)
logging.getLogger("math_verify").setLevel(logging.ERROR)


def final_text(trajectory):
    """The last assistant message's text: a string, one message, or a list of messages."""
    if isinstance(trajectory, str):
        return trajectory
    if isinstance(trajectory, dict):
        return final_text(trajectory.get("content") or "")
    if isinstance(trajectory, list):
        said = [m for m in trajectory if isinstance(m, dict) and m.get("role") == "assistant"]
        return final_text(said[-1]) if said else ""
    raise TypeError(f"unsupported trajectory type {type(trajectory).__name__}")


def score(task, trajectory):
    gold = parse(task["answer"], parsing_timeout=None)
    if not gold:  # a reference nobody can read is a broken task, not a wrong answer
        raise ValueError(f"math-verify cannot parse the reference answer {task['answer']!r}")
    said = parse(final_text(trajectory), parsing_timeout=None)
    return 1.0 if verify(gold, said, timeout_seconds=None) else 0.0
