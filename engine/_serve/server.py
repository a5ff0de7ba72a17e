"""``engine serve``: one ``Engine`` for the process's life, served by uvicorn (httptools) on one event loop.

Why uvicorn and httptools, and how SIGTERM ends it: docs/design.md, The service.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import signal
import threading
from collections.abc import Iterator

import anyio
import uvicorn
import uvicorn.logging

from engine._check import check_ready, environment_dirs
from engine._config import EngineConfig
from engine._core.contract import ENV_NAME
from engine._engine import Engine
from engine._serve.app import App
from engine._serve.connections import Guard
from engine._serve.limits import ServeConfig

__all__ = ["log_to_stderr", "serve"]

logger = logging.getLogger("engine.serve")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
SETTLE = 5.0  # seconds the requests cancelled at shutdown get to send their 503


class _Server(uvicorn.Server):
    """uvicorn's server, whose signal handling ends ``serve`` and nothing more.

    uvicorn raises the signal it caught again once it has shut down, for the process's previous
    handler; here that is the CLI's, which would report the run as interrupted (exit 143). A
    service stopped by SIGTERM has done what it was asked: the signals caught are kept in
    ``stopped_by`` instead, for the command to report.
    """

    stopped_by: list[int]

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        self.stopped_by = []
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.stopped_by = list(self._captured_signals)


def log_to_stderr() -> None:
    """The service's log (the ``engine`` logger's, from INFO) on stderr, its lines as uvicorn writes its own.

    At start: the config, the environments checked; then each failed batch once, at ERROR (``batch aborted``,
    the line a trainer's user looks for beside the trainer's own traceback), and a bug answering a request.
    """
    handler = logging.StreamHandler()
    handler.setFormatter(uvicorn.logging.DefaultFormatter("%(levelprefix)s %(message)s", use_colors=False))
    engine_logger = logging.getLogger("engine")
    engine_logger.addHandler(handler)
    engine_logger.setLevel(logging.INFO)


async def serve(engine_config: EngineConfig, config: ServeConfig) -> list[int]:
    """Serve until a signal stops the service; the signals that did.

    Every environment is checked first, on the engine the service then scores with (its plugins imported once,
    for the service): if one cannot score, the service does not start (``UnreadyError``, naming each).
    """
    root = engine_config.environments
    logger.info("engine serve: config %s, environments under %s", engine_config.source or "(the defaults)", root)
    async with Engine(engine_config) as engine:
        # a directory without a manifest (shared helpers) or whose name no row could give is no environment
        dirs = environment_dirs(root)
        served = [p for p in dirs if ENV_NAME.fullmatch(p.name) and (p / "manifest.json").exists()]
        if skipped := [p.name for p in dirs if p not in served]:
            logger.info("engine serve: not environments (no manifest.json, or not a name): %s", ", ".join(skipped))
        checks = await check_ready(engine, served, which=f"under {root}",
                                   then=", so the service does not start (engine check says more)")
        kinds = ", ".join(f"{check.environment} ({check.kind})" for check in checks)
        count = f"{len(checks)} environment{'' if len(checks) == 1 else 's'}"
        logger.info("engine serve: %s, each checked and able to score: %s", count, kinds or "none")
        guard = Guard(config.head_timeout, config.body_timeout, config.connections())
        app = App(engine, config, guard)
        server = _Server(
            uvicorn.Config(
                app,
                host=config.host,
                port=config.port,
                http=guard.protocol(),  # uvicorn's httptools protocol, under the service's bounds on connections
                lifespan="off",  # the engine is opened around the server
                timeout_keep_alive=config.keep_alive,
                timeout_graceful_shutdown=math.ceil(config.graceful_timeout),  # typed int; whole seconds
                log_level="info",  # says where it listens, and when it stops
                access_log=False,
                server_header=False,
                proxy_headers=False,  # the client's address is used for nothing: no middleware to rewrite it
            )
        )
        # Everything made so far (modules, the engine) lives as long as the process: out of the collector's
        # scans. Parsing a 4,096-item body made 3 ms of collections over them, 1 ms without (measured).
        # This process is the service's own (only `engine serve` runs this), so its GC is ours to tune.
        gc.freeze()
        try:
            await server.serve()
        finally:
            # requests cancelled at the graceful deadline answer 503 on their way out: let them, briefly
            with anyio.move_on_after(SETTLE):
                while server.server_state.tasks:
                    await anyio.sleep(0.01)
            guard.cancel()
            await app.aclose()
        return server.stopped_by
