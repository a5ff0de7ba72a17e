"""Frozen, validated configuration, read from TOML with the standard library.

Every default is a named constant below; a bad value raises ``ConfigError`` naming the key. The refs tables,
headers and the judge's table: docs/design.md, Configuration.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from engine._columns import Columns
from engine._errors import ConfigError
from engine._http.headers import check_headers
from engine._http.network import ca_bundle_problem, credentials_refusal, shown_url, url_problem, without_credentials
from engine._keys import first_unknown, unknown_key

__all__ = [
    "COUNT",
    "DEFAULT_CACHE_BUSY_TIMEOUT",
    "DEFAULT_CACHE_MAX_ENTRIES",
    "DEFAULT_JUDGE_MAX_ATTEMPTS",
    "DEFAULT_JUDGE_MAX_BODY",
    "DEFAULT_JUDGE_MAX_CONCURRENCY",
    "DEFAULT_JUDGE_MAX_RATE",
    "DEFAULT_JUDGE_MAX_TOKENS",
    "DEFAULT_JUDGE_PRICE",
    "DEFAULT_JUDGE_RETRY_DEADLINE",
    "DEFAULT_JUDGE_TEMPERATURE",
    "DEFAULT_JUDGE_TIMEOUT",
    "DEFAULT_MAX_ABANDONED",
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_MAX_CONCURRENCY",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_RETRY_DEADLINE",
    "DEFAULT_SPEND_BUDGET",
    "DEFAULT_THREADS",
    "DEFAULT_TIMEOUT",
    "DEFAULT_TOKEN_BUDGET",
    "RATE",
    "SECONDS",
    "CacheConfig",
    "EngineConfig",
    "JudgeConfig",
    "Limits",
    "Number",
    "load_config",
]

DEFAULT_MAX_CONCURRENCY = 64  # calls in flight at once, per verifier
DEFAULT_TIMEOUT = 60.0  # seconds, per call
DEFAULT_MAX_ATTEMPTS = 5  # first try plus retries, for transient HTTP failures
DEFAULT_RETRY_DEADLINE = 60.0  # seconds from the first try after which no retry starts
DEFAULT_MAX_IN_FLIGHT = 1024  # items in flight at once over all verifiers, however large the batch
DEFAULT_THREADS = 64  # worker threads shared by all sync plugins
DEFAULT_MAX_BODY = 1 << 20  # bytes: an endpoint's response body may be at most 1 MiB
DEFAULT_MAX_ABANDONED = 8  # a thread plugin's timed-out calls still running, beyond which it starts no more
# a judge's spend budgets, per engine ([judge] for all rubrics, a rubric's [refs."owner/name"] for its own)
DEFAULT_TOKEN_BUDGET: int | None = None  # tokens (the replies' usage.total_tokens); None means no budget
DEFAULT_SPEND_BUDGET: float | None = None  # in the currency of the judge's prices; None means no budget
DEFAULT_ENVIRONMENTS = "envs"
DEFAULT_RUBRICS = "rubrics"

# the judge's ([judge] table)
DEFAULT_JUDGE_TEMPERATURE = 0.0  # the same item should get the same grade
DEFAULT_JUDGE_MAX_TOKENS = 512  # room for the JSON and a short reason
DEFAULT_JUDGE_TIMEOUT = 120.0  # seconds per request: a loaded judge can be slow
DEFAULT_JUDGE_MAX_CONCURRENCY = 32  # requests in flight at once, over all rubrics
DEFAULT_JUDGE_MAX_RATE: float | None = None  # requests per second; None means unlimited
DEFAULT_JUDGE_MAX_ATTEMPTS = 5  # first try plus retries
DEFAULT_JUDGE_RETRY_DEADLINE = 300.0  # seconds from the first try; rate-limit waits can be long
DEFAULT_JUDGE_MAX_BODY = 1 << 20  # bytes of reply: far more than max_tokens of JSON, far less than a flood
DEFAULT_JUDGE_PRICE: float | None = None  # per million input (or output) tokens; None: judging has no price

# the verdict cache's ([cache] table)
DEFAULT_CACHE_MAX_ENTRIES = 1_000_000  # verdicts kept; past it the least recently used go (~150 MB of SQLite)
DEFAULT_CACHE_BUSY_TIMEOUT = 5.0  # seconds a write waits for another process's lock before it is skipped

DIGEST_PATTERN = re.compile(r"sha256:[0-9a-f]{64}")
_JUDGE_CALL_KEYS = ("timeout", "max_attempts", "retry_deadline", "max_body")
_BUDGET_KEYS = ("token_budget", "spend_budget")  # a rubric's refs table (and [judge]) only

def _is_endpoint_key(key: str) -> bool:
    return key[:8].lower().startswith(("http://", "https://"))


def _is_rubric_key(key: str) -> bool:
    """A refs key naming a rubric (``owner/name``), not a plugin (``env/mod:fn``) or an endpoint (a URL)."""
    return ":" not in key


def _fail(source: Path | None, key: str, message: str) -> ConfigError:
    return ConfigError(message, key=key, source=source)


@dataclass(frozen=True)
class Number:
    """What a numeric setting must be: a whole number or any finite one, at least ``least`` (more than it when
    ``above``) and at most ``most``; or None, when ``optional``. The one check of every number in a config
    (``Limits``, ``JudgeConfig``, ``EngineConfig``, ``engine serve``'s ``ServeConfig``)."""

    whole: bool
    least: float
    above: bool = False
    most: float | None = None
    optional: bool = False

    def check(self, value: Any, key: str, table: str | None = None, source: Path | None = None) -> Any:
        """``value`` as the setting takes it (a float for a number that need not be whole), or ``ConfigError``
        naming ``key`` (in ``table`` of file ``source``) and saying what it must be."""
        if value is None and self.optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int if self.whole else int | float):
            fits = False
        else:
            low = value > self.least if self.above else value >= self.least
            fits = math.isfinite(value) and low and (self.most is None or value <= self.most)
        if not fits:
            raise ConfigError(f"must be {self}, got {value!r}", key=key, table=table, source=source)
        return value if self.whole else float(value)

    def __str__(self) -> str:
        kind = "a whole number" if self.whole else "a number"
        if self.most is not None:
            return f"{kind} from {self.least:g} to {self.most:g}"
        return f"{kind} {'>' if self.above else '>='} {self.least:g}"


COUNT = Number(whole=True, least=1)  # a whole number >= 1
SECONDS = Number(whole=False, least=0, above=True)  # a number > 0 (of seconds, of calls a second)
RATE = Number(whole=False, least=0, above=True, optional=True)  # calls a second, or None: unlimited
TOKEN_BUDGET = Number(whole=True, least=1, optional=True)  # tokens, or None: no budget
SPEND_BUDGET = Number(whole=False, least=0, above=True, optional=True)  # an amount of money, or None: no budget
PRICE = Number(whole=False, least=0, optional=True)  # per million tokens (0: free), or None: no price

# each number of a Limits, and what it must be
_LIMITS = {
    "max_concurrency": COUNT,
    "max_rate": RATE,
    "timeout": SECONDS,
    "max_attempts": COUNT,
    "retry_deadline": SECONDS,
    "max_body": COUNT,
    "max_abandoned": Number(whole=True, least=0),
    "token_budget": TOKEN_BUDGET,
    "spend_budget": SPEND_BUDGET,
}


@dataclass(frozen=True)
class Limits:
    """How one verifier is called: concurrency, rate, deadline and retry budget."""

    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    max_rate: float | None = None  # calls per second; None means unlimited
    timeout: float = DEFAULT_TIMEOUT
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    retry_deadline: float = DEFAULT_RETRY_DEADLINE
    max_body: int = DEFAULT_MAX_BODY  # bytes an endpoint's response body may have
    # a thread-executor plugin: how many of its abandoned calls (timed out, or cut short by an abort)
    # may still run in threads; past that it fails new calls at once instead of exhausting the pool
    max_abandoned: int = DEFAULT_MAX_ABANDONED
    # a rubric's budgets over the engine's life, on top of the judge's (refused for other kinds, and in [defaults])
    token_budget: int | None = DEFAULT_TOKEN_BUDGET
    spend_budget: float | None = DEFAULT_SPEND_BUDGET
    # an endpoint's extra request headers (see the module docstring); not hashed, a mapping is not hashable
    headers: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:  # built in code, its errors name it "Limits"; a table's, the table (parse)
        for name, rule in _LIMITS.items():
            object.__setattr__(self, name, rule.check(getattr(self, name), name, "Limits"))
        headers = check_headers(
            self.headers, lambda subkey, message: ConfigError(message, key=f"headers{subkey}", table="Limits")
        )
        object.__setattr__(self, "headers", headers)

    @classmethod
    def parse(cls, table: Any, base: Limits, prefix: str, source: Path | None) -> Limits:
        """``base`` with the keys of a TOML table applied over it."""
        if not isinstance(table, Mapping):
            raise _fail(source, prefix, "must be a table")
        known = [f.name for f in fields(cls)]
        if (key := first_unknown(table, known)) is not None:
            raise ConfigError(unknown_key(key, known), key=key, table=prefix, source=source)
        try:
            limits = replace(base, **dict(table))
        except ConfigError as exc:  # its key, in the table of the file it came from
            raise exc.within(prefix, source) from None
        return limits


def _judge_fail(source: Path | None, key: str, message: str) -> ConfigError:
    return ConfigError(message, key=key, table="judge", source=source)


# each number of a JudgeConfig, and what it must be
_JUDGE = {
    "max_concurrency": COUNT,
    "max_tokens": COUNT,
    "max_attempts": COUNT,
    "max_body": COUNT,
    "timeout": SECONDS,
    "retry_deadline": SECONDS,
    "max_rate": RATE,
    "temperature": Number(whole=False, least=0),
    "token_budget": TOKEN_BUDGET,
    "spend_budget": SPEND_BUDGET,
    "price_per_million_input": PRICE,
    "price_per_million_output": PRICE,
}


_ENV_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_UNPRICED = (
    "a spend budget needs the judge's prices: set price_per_million_input and price_per_million_output "
    "under [judge] (in the budget's currency), or set a token_budget instead"
)


@dataclass(frozen=True)
class JudgeConfig:
    """The ``[judge]`` table of the engine's config, validated when built."""

    base_url: str
    model: str
    api_key_env: str | None = None  # the environment variable holding the API key, if the server wants one
    max_concurrency: int = DEFAULT_JUDGE_MAX_CONCURRENCY
    max_rate: float | None = DEFAULT_JUDGE_MAX_RATE
    temperature: float = DEFAULT_JUDGE_TEMPERATURE
    max_tokens: int = DEFAULT_JUDGE_MAX_TOKENS
    timeout: float = DEFAULT_JUDGE_TIMEOUT
    max_attempts: int = DEFAULT_JUDGE_MAX_ATTEMPTS
    retry_deadline: float = DEFAULT_JUDGE_RETRY_DEADLINE
    max_body: int = DEFAULT_JUDGE_MAX_BODY
    response_format: bool = True  # send response_format={"type": "json_object"}
    # budgets over the engine's life, for every rubric together; a spend budget prices tokens with both prices
    token_budget: int | None = DEFAULT_TOKEN_BUDGET
    spend_budget: float | None = DEFAULT_SPEND_BUDGET
    price_per_million_input: float | None = DEFAULT_JUDGE_PRICE
    price_per_million_output: float | None = DEFAULT_JUDGE_PRICE
    # identical items of a batch judged once, and verdicts kept in the [cache] if there is one
    dedupe: bool = True
    # extra headers whose values name environment variables (``engine._http.headers``), for a judge behind
    # a gateway that wants more than a Bearer key; not hashed, a mapping is not hashable
    headers: Mapping[str, str] = field(default_factory=dict, hash=False)
    source: Path | None = None  # the file this came from, for messages

    def __post_init__(self) -> None:
        src = self.source
        if isinstance(self.base_url, str) and (plain := without_credentials(self.base_url)) is not None:
            raise _judge_fail(  # never echo the URL: it holds a password
                src,
                "base_url",
                "the URL carries credentials (user:password@), which would be logged with every request; "
                f"use {plain} and send them in a header read from an environment variable: "
                'headers = { Authorization = "Basic ${JUDGE_AUTH}" } (the variable holding base64 of '
                "user:password), or name the variable holding an API key in api_key_env (sent as a Bearer token)",
            )
        if not isinstance(self.base_url, str) or not re.fullmatch(r"https?://[^\s/?#]+[^\s?#]*", self.base_url):
            shown = shown_url(self.base_url) if isinstance(self.base_url, str) else self.base_url  # a password?
            raise _judge_fail(src, "base_url", f"must be an http:// or https:// URL, got {shown!r}")
        if (problem := url_problem(self.base_url)) is not None:  # found now, not when the engine opens
            raise _judge_fail(src, "base_url", problem)
        if not isinstance(self.model, str) or not self.model.strip():
            raise _judge_fail(src, "model", f"must be the model's name, got {self.model!r}")
        if self.api_key_env is not None and (
            not isinstance(self.api_key_env, str) or not _ENV_VAR.fullmatch(self.api_key_env)
        ):
            # never echo the value: someone may have pasted the key itself here
            raise _judge_fail(
                src, "api_key_env", "must be the name of an environment variable (the key itself goes there)"
            )
        for key, rule in _JUDGE.items():
            object.__setattr__(self, key, rule.check(getattr(self, key), key, "judge", src))
        for name in ("response_format", "dedupe"):
            if not isinstance(getattr(self, name), bool):
                raise _judge_fail(src, name, f"must be true or false, got {getattr(self, name)!r}")
        if (self.price_per_million_input is None) != (self.price_per_million_output is None):
            missing = "price_per_million_output" if self.price_per_million_output is None else "price_per_million_input"
            raise _judge_fail(src, missing, "is needed too: tokens are priced by both prices, or by none")
        if self.spend_budget is not None and not self.priced:
            raise _judge_fail(src, "spend_budget", _UNPRICED)
        headers = check_headers(self.headers, lambda subkey, message: _judge_fail(src, f"headers{subkey}", message))
        if self.api_key_env is not None and any(name.lower() == "authorization" for name in headers):
            raise _judge_fail(src, "headers.Authorization", "api_key_env sends it already: set one or the other")
        object.__setattr__(self, "headers", headers)

    @property
    def priced(self) -> bool:
        """Whether its tokens have prices (both are set, or neither)."""
        return self.price_per_million_input is not None

    @property
    def url(self) -> str:
        """Where completions are requested."""
        return self.base_url.rstrip("/") + "/chat/completions"

    @classmethod
    def from_table(cls, table: Mapping[str, Any], source: Path | None = None) -> JudgeConfig:
        """A config from the parsed ``[judge]`` TOML table; ``ConfigError`` names the bad key."""
        if not isinstance(table, Mapping):
            raise _fail(source, "judge", "must be a table")
        known = [f.name for f in fields(cls) if f.name != "source"]
        for key in table:
            if key == "api_key":
                reason = "an API key is never written in the config: name its variable in api_key_env"
                raise _judge_fail(source, key, reason)
            if key not in known:
                raise _judge_fail(source, key, unknown_key(key, known))
        for key in ("base_url", "model"):
            if key not in table:
                raise _judge_fail(source, key, "is required")
        return cls(**dict(table), source=source)


_CACHE = {"max_entries": COUNT, "busy_timeout": SECONDS}


@dataclass(frozen=True)
class CacheConfig:
    """The ``[cache]`` table: where the judge's verdicts are kept across batches and processes; validated."""

    path: Path
    max_entries: int = DEFAULT_CACHE_MAX_ENTRIES
    busy_timeout: float = DEFAULT_CACHE_BUSY_TIMEOUT
    source: Path | None = None  # the file this came from, for messages

    def __post_init__(self) -> None:
        if not isinstance(self.path, str | Path) or not str(self.path):
            raise ConfigError(f"must be the cache file's path, got {self.path!r}", key="path", table="cache",
                              source=self.source)
        object.__setattr__(self, "path", Path(self.path))
        for key, rule in _CACHE.items():
            object.__setattr__(self, key, rule.check(getattr(self, key), key, "cache", self.source))

    @classmethod
    def from_table(cls, table: Any, base_dir: Path, source: Path | None = None) -> CacheConfig:
        """A config from the parsed ``[cache]`` TOML table, its path relative to ``base_dir``."""
        if not isinstance(table, Mapping):
            raise _fail(source, "cache", "must be a table")
        known = [f.name for f in fields(cls) if f.name != "source"]
        if (key := first_unknown(table, known)) is not None:
            raise ConfigError(unknown_key(key, known), key=key, table="cache", source=source)
        if "path" not in table:
            raise ConfigError("is required", key="path", table="cache", source=source)
        path = table["path"]
        if not isinstance(path, str) or not path:
            raise ConfigError(f"must be the cache file's path, got {path!r}", key="path", table="cache", source=source)
        return cls(**{**table, "path": base_dir / path}, source=source)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know. Build it directly or with :func:`load_config`."""

    environments: Path = Path(DEFAULT_ENVIRONMENTS)
    allow_unpinned: bool = False
    pins: Mapping[str, str] = field(default_factory=dict)
    defaults: Limits = Limits()
    refs: Mapping[str, Limits] = field(default_factory=dict)
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    threads: int = DEFAULT_THREADS
    rubrics: Path = Path(DEFAULT_RUBRICS)  # the rubric registry: <rubrics>/<owner>/<name>/<N>.md
    judge: JudgeConfig | None = None  # None: rubric verifiers fail, saying no judge is configured
    cache: CacheConfig | None = None  # None: no verdicts kept between batches (a batch still dedupes)
    # PEM CA certificates trusted for HTTPS (endpoints and the judge) on top of the default trust
    ca_bundle: Path | None = None
    # where a backfill's input row keeps each field ([input.columns]): field (or task.<key>) -> source column
    input_columns: Mapping[str, str] = field(default_factory=dict)
    source: Path | None = None  # the file this came from, for messages

    def __post_init__(self) -> None:
        src = self.source
        object.__setattr__(self, "environments", Path(self.environments))
        object.__setattr__(self, "rubrics", Path(self.rubrics))
        if self.ca_bundle is not None:
            object.__setattr__(self, "ca_bundle", Path(self.ca_bundle))
            problem = ca_bundle_problem(self.ca_bundle)
            if problem is not None:
                raise _fail(src, "ca_bundle", problem)
        if self.judge is not None and not isinstance(self.judge, JudgeConfig):
            raise _fail(src, "judge", f"must be a JudgeConfig, got {type(self.judge).__name__}")
        if self.cache is not None and not isinstance(self.cache, CacheConfig):
            raise _fail(src, "cache", f"must be a CacheConfig, got {type(self.cache).__name__}")
        if not isinstance(self.allow_unpinned, bool):
            raise _fail(src, "allow_unpinned", f"must be true or false, got {self.allow_unpinned!r}")
        if not isinstance(self.pins, Mapping):
            raise _fail(src, "pins", "must be a mapping of environment name to digest")
        if not isinstance(self.refs, Mapping):
            raise _fail(src, "refs", "must be a mapping of verifier key to Limits")
        if not isinstance(self.defaults, Limits):
            raise _fail(src, "defaults", f"must be a Limits, got {type(self.defaults).__name__}")
        for name, digest in self.pins.items():
            if not isinstance(digest, str) or not DIGEST_PATTERN.fullmatch(digest):
                raise _fail(src, f"pins.{name}", f"must look like 'sha256:<64 hex digits>', got {digest!r}")
        if self.defaults.headers:
            raise _fail(src, "defaults.headers", 'headers go under one endpoint\'s [refs."<url>"], not [defaults]')
        for name in _BUDGET_KEYS:
            if getattr(self.defaults, name) is not None:
                raise _fail(src, f"defaults.{name}",
                            'a budget is one rubric\'s (under its [refs."owner/name"]) or every rubric\'s '
                            "(under [judge]), not [defaults]")
        for key, limits in self.refs.items():
            if not isinstance(limits, Limits):
                raise _fail(src, f"refs.{key!r}", "must be a Limits")
            if limits.headers and not _is_endpoint_key(key):
                raise _fail(src, f"refs.{key!r}.headers", "only an endpoint (a refs key that is its URL) sends headers")
            for name in _BUDGET_KEYS:
                if getattr(limits, name) is not None and not _is_rubric_key(key):
                    raise _fail(src, f"refs.{key!r}.{name}",
                                "only a rubric (a refs key that is its owner/name) or the judge has a budget: "
                                "plugins and endpoints spend nothing the engine can count")
            if limits.spend_budget is not None and (self.judge is None or not self.judge.priced):
                raise _fail(src, f"refs.{key!r}.spend_budget", _UNPRICED)
            if _is_rubric_key(key):
                for name in _JUDGE_CALL_KEYS:
                    if getattr(limits, name) != getattr(self.defaults, name):
                        raise _fail(
                            src,
                            f"refs.{key!r}.{name}",
                            "a rubric's calls are the judge's: set timeout, max_attempts, retry_deadline and "
                            "max_body under [judge]; a rubric's refs table takes max_concurrency and max_rate",
                        )
        COUNT.check(self.max_in_flight, "max_in_flight", source=src)
        COUNT.check(self.threads, "threads", source=src)
        if not isinstance(self.input_columns, Mapping):
            raise _fail(src, "input.columns", "must be a table of field = source column")
        columns = Columns.of(self.input_columns, lambda key, problem: _fail(src, f"input.columns.{key}", problem))
        object.__setattr__(self, "input_columns", MappingProxyType({} if columns.is_default else columns.mapping))
        object.__setattr__(self, "pins", MappingProxyType(dict(self.pins)))
        object.__setattr__(self, "refs", MappingProxyType(dict(self.refs)))

    def limits_for(self, key: str) -> Limits:
        """The limits of the verifier named ``key`` (see the module docstring for its form)."""
        return self.refs.get(key, self.defaults)


_TOP_LEVEL = {
    "environments", "allow_unpinned", "pins", "defaults", "refs", "max_in_flight", "threads", "rubrics", "judge",
    "ca_bundle", "input", "cache",
}
_INPUT = {"columns"}  # the keys of [input]


def config_from_mapping(data: Mapping[str, Any], *, base_dir: Path, source: Path | None = None) -> EngineConfig:
    """Build an :class:`EngineConfig` from parsed TOML; relative paths are taken from ``base_dir``."""
    if (key := first_unknown(data, _TOP_LEVEL)) is not None:
        raise _fail(source, key, unknown_key(key, _TOP_LEVEL))
    environments = data.get("environments", DEFAULT_ENVIRONMENTS)
    if not isinstance(environments, str) or not environments:
        raise _fail(source, "environments", f"must be a directory path, got {environments!r}")
    rubrics = data.get("rubrics", DEFAULT_RUBRICS)
    if not isinstance(rubrics, str) or not rubrics:
        raise _fail(source, "rubrics", f"must be a directory path, got {rubrics!r}")
    ca_bundle = data.get("ca_bundle")
    if ca_bundle is not None and (not isinstance(ca_bundle, str) or not ca_bundle):
        raise _fail(source, "ca_bundle", f"must be the path of a PEM file of CA certificates, got {ca_bundle!r}")
    judge_table = data.get("judge")
    if judge_table is not None and not isinstance(judge_table, Mapping):
        raise _fail(source, "judge", "must be a table")
    judge = JudgeConfig.from_table(judge_table, source) if judge_table is not None else None
    cache = CacheConfig.from_table(data["cache"], base_dir, source) if "cache" in data else None
    pins = data.get("pins", {})
    if not isinstance(pins, Mapping):
        raise _fail(source, "pins", "must be a table of environment name = digest")
    defaults = Limits.parse(data.get("defaults", {}), Limits(), "defaults", source)
    refs_table = data.get("refs", {})
    if not isinstance(refs_table, Mapping):
        raise _fail(source, "refs", 'must be a table of [refs."<verifier>"] tables')
    for key in refs_table:
        if _is_endpoint_key(key) and (plain := without_credentials(key)) is not None:
            raise _fail(source, f"refs.{plain!r}", credentials_refusal(plain))  # never echo the key
        if _is_endpoint_key(key) and (problem := url_problem(key)) is not None:
            raise _fail(source, f"refs.{shown_url(key)!r}", problem)
    refs = {key: Limits.parse(table, defaults, f"refs.{key!r}", source) for key, table in refs_table.items()}
    input_table = data.get("input", {})
    if not isinstance(input_table, Mapping):
        raise _fail(source, "input", "must be a table ([input.columns])")
    if (key := first_unknown(input_table, _INPUT)) is not None:
        raise ConfigError(unknown_key(key, _INPUT), key=key, table="input", source=source)
    return EngineConfig(
        environments=base_dir / environments,
        allow_unpinned=data.get("allow_unpinned", False),
        pins=pins,
        defaults=defaults,
        refs=refs,
        max_in_flight=data.get("max_in_flight", DEFAULT_MAX_IN_FLIGHT),
        threads=data.get("threads", DEFAULT_THREADS),
        rubrics=base_dir / rubrics,
        judge=judge,
        cache=cache,
        ca_bundle=base_dir / ca_bundle if ca_bundle is not None else None,
        input_columns=input_table.get("columns", {}),
        source=source,
    )


def load_config(path: str | Path) -> EngineConfig:
    """Read a TOML config file; relative paths in it are relative to the file."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return config_from_mapping(data, base_dir=path.parent, source=path)
