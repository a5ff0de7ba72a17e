"""Cheap enough to be called in chunks; a task's "mode" makes one call misbehave."""

import math
import os
import threading
import time

calls = 0
running = 0
max_running = 0  # the most calls in progress at once
_lock = threading.Lock()


def score(task, trajectory):
    global calls, running, max_running
    with _lock:
        calls += 1
        running += 1
        max_running = max(max_running, running)
    try:
        return _score(task)
    finally:
        with _lock:
            running -= 1


def _score(task):
    mode = task.get("mode")
    if mode is None:
        return float(task["n"] % 7) / 7
    if mode == "spin":  # keep a CPU busy, holding the GIL, as Python code does
        until = time.perf_counter() + task["seconds"]
        while time.perf_counter() < until:
            pass
        return 1.0
    if mode == "wait":  # wait without a CPU, as blocking I/O does
        time.sleep(task["seconds"])
        return 1.0
    if mode == "raise":
        raise ArithmeticError(f"cannot score item {task['n']}")
    if mode == "hang":  # for task["seconds"], or until the file task["release"] names exists, if sooner
        until, release = time.monotonic() + task.get("seconds", 30), task.get("release")
        if release is None:
            time.sleep(until - time.monotonic())
        while release is not None and not os.path.exists(release) and time.monotonic() < until:
            time.sleep(0.005)
    junk = {"nan": math.nan, "none": None, "text": "high", "numeric_text": "0.5", "int": 1, "huge": 1e308}
    return 1.0 if mode == "hang" else junk[mode]
