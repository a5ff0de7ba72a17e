"""A plugin that fails in the way each task asks, for the failure-mode tests."""

import math
import time


class Boom(RuntimeError):
    pass


def by_task(task, trajectory):
    mode = task.get("mode", "ok")
    if mode == "ok":
        return 0.5
    if mode == "raise":
        raise Boom("the plugin blew up")
    if mode == "exit":
        raise SystemExit(3)
    if mode == "hang":
        time.sleep(task.get("seconds", 30))
        return 1.0
    return {"none": None, "text": "high", "nan": math.nan, "inf": math.inf, "list": [1.0], "numeric_text": "0.75",
            "bool": True}[mode]
