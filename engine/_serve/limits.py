"""What ``engine serve`` is told at start (its address, token and limits), and the admission of batches.

Refused for good (413) or for now (503 and ``Retry-After``): docs/design.md, The service (Admission).
"""

from __future__ import annotations

import ipaddress
import math
import resource
from dataclasses import dataclass

from engine._http.headers import token_problem

__all__ = [
    "BODY_TIMEOUT",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "GATHER_CALL",
    "GATHER_ITEMS",
    "GRACEFUL_TIMEOUT",
    "HEAD_TIMEOUT",
    "KEEP_ALIVE",
    "MAX_BYTES",
    "MAX_GATHERED",
    "MAX_ITEMS",
    "MAX_QUEUED",
    "RETRY_AFTER",
    "Admission",
    "ServeConfig",
    "is_loopback",
]

DEFAULT_HOST = "127.0.0.1"  # this machine only, unless told otherwise (with a token)
DEFAULT_PORT = 8000
MAX_ITEMS = 65_536  # items in one request: a large GRPO step's rollouts
MAX_BYTES = 256 * 1024 * 1024  # bytes of one request body
MAX_QUEUED = 262_144  # items admitted across requests, queued or in flight, before new ones get 503
GRACEFUL_TIMEOUT = 60.0  # seconds in-flight batches get to finish after SIGTERM
RETRY_AFTER = 1  # seconds a saturated service asks a client to wait (Retry-After)
GATHER_ITEMS = 256  # a request of at most this many plugin items may share an engine batch (engine._serve.gather)
MAX_GATHERED = 4096  # items one gathered batch takes at most
HEAD_TIMEOUT = 10.0  # seconds a connection has to send a request's head (line and headers) once it waits for one
KEEP_ALIVE = 5  # seconds an idle kept-alive connection stays open (uvicorn's default)
BODY_TIMEOUT = 60.0  # seconds a request has to send its whole body, once its head is in
MAX_CONNECTIONS = 65_536  # connections at most where the open-file limit sets none
FILES_KEPT = 256  # open files the service keeps for itself (plugin workers, endpoints' connections, logs)
GATHER_CALL = 0.01  # seconds an item of a plugin takes, at most, on its recent batches' mean, to be gathered


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the service to this machine (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


@dataclass(frozen=True)
class ServeConfig:
    """The service's settings: validated on construction (``ValueError`` saying which and why)."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    token: str | None = None
    environment: str | None = None  # what /get_reward scores a label that is not an item against
    max_items: int = MAX_ITEMS
    max_bytes: int = MAX_BYTES
    max_queued: int = MAX_QUEUED
    graceful_timeout: float = GRACEFUL_TIMEOUT
    retry_after: int = RETRY_AFTER
    gather_items: int = GATHER_ITEMS  # 0: no request shares a batch
    head_timeout: float = HEAD_TIMEOUT
    keep_alive: int = KEEP_ALIVE
    body_timeout: float = BODY_TIMEOUT
    max_connections: int | None = None  # None: as many as the open-file limit leaves (less FILES_KEPT)

    def __post_init__(self) -> None:
        if not is_loopback(self.host) and not self.token:
            raise ValueError(
                f"refusing to serve on {self.host}, which is not a loopback address, without a token: "
                "pass --token-env NAME (the token is read from that variable) or bind 127.0.0.1"
            )
        if self.token is not None and (problem := token_problem(self.token)):
            raise ValueError(f"the token {problem}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        for name in ("max_items", "max_bytes", "max_queued", "retry_after"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.max_items > self.max_queued:
            raise ValueError(f"max_items ({self.max_items}) must not exceed max_queued ({self.max_queued}): "
                             "a batch that large could never be admitted")
        if type(self.gather_items) is not int or not 0 <= self.gather_items <= MAX_GATHERED:
            raise ValueError(f"gather_items must be a whole number from 0 to {MAX_GATHERED}, got {self.gather_items!r}")
        if not self.graceful_timeout >= 0:
            raise ValueError(f"graceful_timeout must be >= 0 seconds, got {self.graceful_timeout!r}")
        for name in ("head_timeout", "body_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if type(self.keep_alive) is not int or self.keep_alive < 1:
            raise ValueError(f"keep_alive must be a whole number of seconds >= 1, got {self.keep_alive!r}")
        if self.max_connections is not None and (type(self.max_connections) is not int or self.max_connections < 1):
            raise ValueError(f"max_connections must be a whole number >= 1, got {self.max_connections!r}")

    def connections(self) -> int:
        """The connections the service keeps open at most: ``max_connections``, within the open-file limit."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        room = None if soft == resource.RLIM_INFINITY else max(1, soft - FILES_KEPT)
        wanted = self.max_connections
        if wanted is None:
            return room if room is not None else MAX_CONNECTIONS
        return wanted if room is None else min(wanted, room)


class Admission:
    """The items admitted and not yet answered, across requests, held to ``capacity``.

    A count on the event loop, not a limiter: a batch that does not fit is refused at once (503), never
    queued here, so a client retries and a saturated service sheds load instead of holding connections.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0

    def admit(self, items: int) -> bool:
        """Take ``items`` if they fit; whether they did."""
        if self.held + items > self.capacity:
            return False
        self.held += items
        return True

    def release(self, items: int) -> None:
        self.held -= items
