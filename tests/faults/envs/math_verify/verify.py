"""math-verify as a plugin: the answer in the task against the one in the trajectory.

Nothing here catches an exception: math-verify uses ``signal.alarm`` for its parsing and
comparison timeouts, which works only in a process's main thread. In a thread it raises
``ValueError`` ("... doesn't support threaded environment ..."), and that must reach the engine as
an error: a plugin that caught it and returned 0.0 would turn a broken verifier into silent zeros.
"""

from math_verify import parse, verify


def score(task, trajectory):
    return 1.0 if verify(parse(task["answer"]), parse(trajectory)) else 0.0
