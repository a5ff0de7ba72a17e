"""Scores 1.0 only if the task's ``reference`` is exactly the integer 2**64 + 1: a float (a rounded read) scores 0."""


def score(task, trajectory):
    reference = task["reference"]
    return 1.0 if type(reference) is int and reference == 2**64 + 1 else 0.0
