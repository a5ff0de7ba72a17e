"""verl's GSM8K reward (``#### <answer>`` at the end of the response), on the task a verl row gives through a column
mapping: exactly ``prompt`` (its chat messages, each ``role`` and ``content`` text) and ``reference`` (the ground
truth, text). A task of any other shape or type raises: a mapping that reads the wrong thing fails, never scores 0."""


def _messages(prompt):
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(m, dict) and set(m) == {"role", "content"} and all(type(v) is str for v in m.values())
        for m in prompt
    )


def score(task, trajectory):
    if set(task) != {"prompt", "reference"} or type(task["reference"]) is not str or not _messages(task["prompt"]):
        raise TypeError(f"not a verl task of prompt and reference: {task!r}")
    if type(trajectory) is not str:
        raise TypeError(f"the response must be text, got {type(trajectory).__name__}")
    _, sep, answer = trajectory.rpartition("####")
    return 1.0 if sep and answer.strip() == task["reference"] else 0.0
