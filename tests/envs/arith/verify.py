from . import normalize


def score(task, trajectory):
    return 1.0 if normalize.answer(trajectory) == normalize.answer(task["reference"]) else 0.0
