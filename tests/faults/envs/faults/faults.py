"""The fault-injection suite's plugin: each task's "mode" says how the call misbehaves.

The suite runs it as it is (thread executor) and as a copy whose manifest asks for worker
processes. Waits are bounded, so nothing this plugin does outlives a test run.
"""

import asyncio
import ctypes
import math
import os
import subprocess
import sys
import threading
import time

_children = []  # kept: a Popen object collected while its process runs warns


class Boom(RuntimeError):
    """Under the process executor this class exists only in the worker: the exception travels as text."""


class FunctionTimedOut(BaseException):
    """As func_timeout's (pytest's Skipped is another): not an Exception, and the plugin's all the same."""


class ExitingFloat(float):
    """A real number whose ``__float__`` (the plugin's code, run where the engine reads the reward) exits."""

    def __float__(self):
        sys.exit(3)


class DyingFloat(float):
    """A real number whose ``__float__`` ends its process at once, as a crash in a C extension would."""

    def __float__(self):
        os._exit(7)


def _wait_for(path, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.005)


def _write_pid(path, pid=None):
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        f.write(str(pid or os.getpid()))
    os.replace(temporary, path)  # whoever waits for the file never reads half of it


def by_task(task, trajectory):
    mode = task.get("mode", "ok")
    if "childfile" in task:  # a subprocess of the plugin's own, left running (60 s: past any test)
        _children.append(subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL))
        _write_pid(task["childfile"], _children[-1].pid)
    if "pidfile" in task:
        _write_pid(task["pidfile"])
    if mode == "ok":
        return 0.5
    if mode == "raise":
        raise Boom("the plugin blew up")
    if mode == "exit":
        sys.exit(3)
    if mode == "os_exit":
        os._exit(7)
    if mode == "segfault":
        ctypes.string_at(0)
    if mode == "block":  # a hang that the test ends by creating task["release"] (or never, for a worker it kills)
        _wait_for(task["release"])
        return 1.0
    if mode == "raise_when":  # fail once task["when"] exists: an abort while other calls are in flight
        _wait_for(task["when"])
        raise Boom(f"cue {os.path.basename(task['when'])} seen")
    if mode == "base_exception":
        raise FunctionTimedOut("too slow")
    if mode == "cancelled":  # the plugin's own CancelledError: nothing cancels the engine's task
        raise asyncio.CancelledError("the plugin's own")
    if mode == "float_exit":
        return ExitingFloat(0.5)
    if mode == "float_os_exit":
        return DyingFloat(0.5)
    if mode == "pid":
        return float(os.getpid())
    if mode == "main_thread":
        return 1.0 if threading.current_thread() is threading.main_thread() else 0.0
    return {"none": None, "text": "high", "nan": math.nan, "inf": math.inf}[mode]


async def async_by_task(task, trajectory):
    """The same faults from an ``async def`` plugin, and one only it can cause."""
    await asyncio.sleep(0)
    if task.get("mode") == "hold_loop_then_raise":  # an abort that comes just after another call's answer
        while not os.path.exists(task["when"]):  # that call has started
            await asyncio.sleep(0.001)
        open(task["release"], "w").close()  # let it answer...
        time.sleep(0.05)  # ...while the engine's event loop stands still: the answer waits its turn
        raise Boom("held the loop")
    return by_task(task, trajectory)
