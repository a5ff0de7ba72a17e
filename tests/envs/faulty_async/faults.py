import asyncio


async def by_task(task, trajectory):
    mode = task.get("mode", "ok")
    if mode == "hang":
        await asyncio.sleep(task.get("seconds", 30))
    if mode == "raise":
        raise ValueError("async plugin failed")
    return 0.5
