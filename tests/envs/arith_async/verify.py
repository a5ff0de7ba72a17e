import asyncio


async def score(task, trajectory):
    await asyncio.sleep(0)
    return 1.0 if str(trajectory).strip() == str(task["reference"]) else 0.0
