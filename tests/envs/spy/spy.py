"""Records the largest number of calls in flight at once, for the limit tests."""

import threading
import time

_lock = threading.Lock()
running = 0
max_running = 0
calls = 0


def score(task, trajectory):
    global running, max_running, calls
    with _lock:
        running += 1
        calls += 1
        max_running = max(max_running, running)
    try:
        time.sleep(task.get("sleep", 0.01))
    finally:
        with _lock:
            running -= 1
    return 1.0
