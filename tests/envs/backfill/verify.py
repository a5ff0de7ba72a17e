"""The plugin of the ``engine score`` tests: a deterministic reward, and knobs read on every call.

* ``ENGINE_TEST_CALL_LOG``: a file each call appends its task's ``n`` to (which rows were scored);
* ``ENGINE_TEST_SLEEP``: seconds each call sleeps (a run slow enough to kill part-way through);
* ``ENGINE_TEST_FIXED``: a file; a task with ``"poison": true`` raises until that file exists;
* ``ENGINE_TEST_HOLD``: seconds a task with ``"hold": true`` sleeps (a run that cannot end before it is stopped).
"""

import os
import time


class Poisoned(RuntimeError):
    pass


def _log(n):
    path = os.environ.get("ENGINE_TEST_CALL_LOG")
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{n}\n".encode())  # one write with O_APPEND: lines never interleave
        finally:
            os.close(fd)


def score(task, trajectory):
    n = task["n"]
    _log(n)
    delay = float(os.environ.get("ENGINE_TEST_SLEEP", "0"))
    if delay:
        time.sleep(delay)
    if task.get("hold"):
        time.sleep(float(os.environ.get("ENGINE_TEST_HOLD", "0")))
    if task.get("poison") and not os.path.exists(os.environ.get("ENGINE_TEST_FIXED", "")):
        raise Poisoned(f"task {n} is poisoned until the verifier is fixed")
    return (n * 37 % 101) / 100 + len(str(trajectory)) / 1000
