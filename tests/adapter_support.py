"""What the adapter tests share: an engine config file over the test's environments, and a loop in a
daemon thread (as TRL and slime run theirs). Their fixtures (``engine_toml``, ``trainer_loop``) are in
``tests/conftest.py``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
CALL_TIMEOUT = 60.0  # seconds a test waits for a call on another thread's loop (a hang fails, not blocks)


def write_config(envs: Path, **settings: str) -> Path:
    """An engine config file next to ``envs``, its environments unpinned; returns its path."""
    lines = [f'environments = "{envs}"', "allow_unpinned = true"]
    lines += [f"{key} = {value}" for key, value in settings.items()]
    path = envs.parent / "engine.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


class LoopThread:
    """An event loop running for ever in a daemon thread, as TRL's (and slime's rollout loop) does."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="trainer-loop", daemon=True)
        self.thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` there and block on its result, as the trainer's step does."""
        return self.submit(coroutine).result(CALL_TIMEOUT)

    def shut(self) -> None:
        """Shut the loop down as ``asyncio.run`` would: its async generators (and the adapters' engines) closed."""
        if not self.loop.is_closed():
            self.call(self.loop.shutdown_asyncgens())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(CALL_TIMEOUT)
            self.loop.close()

