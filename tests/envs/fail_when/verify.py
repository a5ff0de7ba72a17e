"""Fails on cue: waits (a bounded while) for the file ``task["when"]`` to appear, then raises.

The abort tests use it to fail a plugin item only once the other lanes are busy, without timing.
"""

import asyncio
import os


class Cue(RuntimeError):
    pass


async def score(task, trajectory):
    for _ in range(800):
        if os.path.exists(task["when"]):
            raise Cue(f"cue {task['when']} seen")
        await asyncio.sleep(0.005)
    return 1.0
