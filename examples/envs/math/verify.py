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
    """The last assistant message's text: a string, one message, or a list of messages.

    A message's ``content`` is a string or a list of parts (``{"type": "text", "text": ...}``), as
    OpenAI-style chat APIs send it. A trajectory with no assistant text to read (no assistant
    message, ``content`` missing or None) is a broken item, so it raises: scoring it 0.0 would pass
    for a wrong answer. An empty string is an answer, and an empty one.
    """
    if isinstance(trajectory, str):
        return trajectory
    if isinstance(trajectory, dict):
        return content_text(trajectory.get("content"))
    if isinstance(trajectory, list):
        said = [m for m in trajectory if isinstance(m, dict) and m.get("role") == "assistant"]
        if not said:
            raise ValueError("the trajectory has no assistant message to score")
        return final_text(said[-1])
    raise TypeError(f"unsupported trajectory type {type(trajectory).__name__}")


def content_text(content):
    """A message's ``content`` as text: a string, or its text parts joined (other parts, images, skipped)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [part["text"] for part in content if isinstance(part, dict) and part.get("type") == "text"]
        if not texts or not all(isinstance(text, str) for text in texts):
            raise ValueError(f"the assistant's content has no text part: {content!r:.200}")
        return "".join(texts)
    raise ValueError(f"the assistant message has no text content (content is {type(content).__name__})")


def score(task, trajectory):
    # raise_on_error: without it, an exception inside math-verify (sympy's, say) comes back as "no match", a 0.0
    gold = parse(task["answer"], parsing_timeout=None, raise_on_error=True)
    if not gold:  # a reference nobody can read is a broken task, not a wrong answer
        raise ValueError(f"math-verify cannot parse the reference answer {task['answer']!r}")
    said = parse(final_text(trajectory), parsing_timeout=None, raise_on_error=True)
    return 1.0 if verify(gold, said, timeout_seconds=None, raise_on_error=True) else 0.0
