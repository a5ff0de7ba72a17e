"""What ``engine serve`` is told at start (its address, token and limits), and the admission of batches.

Refused for good (413) or for now (503 and ``Retry-After``): docs/design.md, The service (Admission).
"""

from __future__ import annotations

import ipaddress
import resource
from dataclasses import dataclass

from engine._config import COUNT, SECONDS, Number
from engine._errors import ConfigError
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


# each number of a ServeConfig, and what it must be
_NUMBERS = {
    "port": Number(whole=True, least=0, most=65535),
    "max_items": COUNT,
    "max_bytes": COUNT,
    "max_queued": COUNT,
    "retry_after": COUNT,
    "gather_items": Number(whole=True, least=0, most=MAX_GATHERED),
    "graceful_timeout": Number(whole=False, least=0),
    "head_timeout": SECONDS,
    "body_timeout": SECONDS,
    "keep_alive": COUNT,
    "max_connections": Number(whole=True, least=1, optional=True),
}


@dataclass(frozen=True)
class ServeConfig:
    """The service's settings: validated on construction (``ConfigError`` naming the setting and saying why)."""

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
            raise ConfigError(
                f"refusing to serve on {self.host}, which is not a loopback address, without a token: "
                "pass --token-env NAME (the token is read from that variable) or bind 127.0.0.1",
                key="host",
            )
        if self.token is not None and (problem := token_problem(self.token)):
            raise ConfigError(f"the token {problem}", key="token")
        for name, rule in _NUMBERS.items():
            object.__setattr__(self, name, rule.check(getattr(self, name), name))
        if self.max_items > self.max_queued:
            raise ConfigError(f"must not exceed max_queued ({self.max_queued}), got {self.max_items}: a batch that "
                              "large could never be admitted", key="max_items")

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
