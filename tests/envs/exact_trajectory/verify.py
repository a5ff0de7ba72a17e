"""Scores 1.0 only if the trajectory is exactly ``task["expected"]``, types included at every depth (a text
decoded into a list, or a list left as text, scores 0); ``calls`` holds every (task, trajectory) it was given."""

calls = []


def _same(a, b):
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    return a == b


def score(task, trajectory):
    calls.append((task, trajectory))
    return 1.0 if _same(trajectory, task["expected"]) else 0.0
