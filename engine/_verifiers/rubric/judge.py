"""The LLM judge: the client that grades one item against one rubric through any OpenAI-compatible chat API.

vLLM, SGLang, llama.cpp's server, OpenAI and others serve ``POST {base_url}/chat/completions``.
The judge sends the rubric, the task's prompt, its reference (when there is one) and the
flattened trajectory, asks for ``{"score": <number>, "reason": "..."}`` and parses the reply
strictly (``engine._verifiers.rubric.prompt`` writes the prompt and reads the reply): anything but
one JSON object with a number ``score`` inside the rubric's scale (a ```` ```json ```` fence around
it is tolerated) is a failure (``engine._errors.Failure``, which the engine reports as the item's
``VerificationError``), never a default score.

Reasoning models must not put their thinking in ``content``: serve them with the server's
reasoning parser (vLLM and SGLang: ``--reasoning-parser``), which moves it to ``reasoning_content``.

The judge has its own concurrency and rate limits, shared by every rubric it grades, because
judge APIs have request quotas of their own; the time a grade waits for them is reported as
waiting, not as time in the verifier (``engine._core.meters.waiting``). Throttling (429) and
server errors (5xx) are retried with backoff, honouring ``Retry-After``, within a bounded budget.
The API key is read from the environment variable the config names, on every request, as are
the variables of ``headers`` (``engine._http.headers``); they are never stored or logged, and a
reply that echoes one has it scrubbed before any of the reply goes into a message.

Every request is the one bounded POST an endpoint's call is (``engine._http.post``): ``timeout``
seconds for the whole request (not per phase), and ``max_body`` bytes of reply (1 MiB by default),
refused rather than read past.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import anyio
import httpx
import orjson

from engine._config import JudgeConfig
from engine._core.meters import Meter, held, waiting
from engine._errors import Failure
from engine._http.headers import fill_headers
from engine._http.post import Post
from engine._http.retry import RETRY_STATUSES, Sleep
from engine._reasons import Scrubber, excerpt
from engine._verifiers.rubric.prompt import build_messages, parse_score, reply_content
from engine._verifiers.rubric.registry import Rubric

__all__ = ["JUDGE_RETRY_STATUSES", "Judge", "Usage"]

# 429 and every 5xx: a judge behind a gateway answers 500 for an overloaded model as often as 503.
JUDGE_RETRY_STATUSES = RETRY_STATUSES | frozenset(range(500, 600))


@dataclass
class Usage:
    """What judging cost: requests sent (retries among them) and tokens, as the replies report them.

    Add a reply's ``usage`` object with :meth:`add`; subtract two snapshots for the cost of what
    happened between them (``Judge.usage`` returns a snapshot).
    """

    requests: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    def add(self, usage: Any) -> None:
        """Add the token counts of a reply's ``usage`` object; counts that are not whole numbers are skipped."""
        if not isinstance(usage, dict):
            return

        def count(name: str) -> int:
            value = usage.get(name)
            return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0

        prompt, completion = count("prompt_tokens"), count("completion_tokens")
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.total_tokens += count("total_tokens") if "total_tokens" in usage else prompt + completion

    def __sub__(self, other: Usage) -> Usage:
        return Usage(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def copy(self) -> Usage:
        return Usage(**asdict(self))

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


# identity: a compressed reply could inflate past max_body after the transport has checked it
_HEADERS = {"content-type": "application/json", "accept": "application/json", "accept-encoding": "identity"}


class Judge:
    """A judge model behind an OpenAI-compatible API, with its own limits and cost accounting.

    One judge serves every rubric of an engine. ``sleep`` is what retries wait with.
    """

    def __init__(self, config: JudgeConfig, client: httpx.AsyncClient, *, sleep: Sleep = anyio.sleep) -> None:
        self.config = config
        self._post = Post(config.url, client, config, sleep=sleep, retry_statuses=JUDGE_RETRY_STATUSES)
        self._meter = Meter.of(config.max_concurrency, config.max_rate)
        self._usage = Usage()

    @property
    def usage(self) -> Usage:
        """A snapshot of everything judged so far; ``after - before`` is the cost in between."""
        return self._usage.copy()

    def _headers(self, ref: str) -> tuple[dict[str, str], Scrubber | None]:
        """The request's headers, and what scrubs the API key and header variables (if any) from messages."""
        config = self.config
        name = config.api_key_env
        if name is None and not config.headers:
            return _HEADERS, None
        headers, secrets = fill_headers(config.headers.items(), lambda reason: Failure(f"the judge's {reason}"))
        headers = {**_HEADERS, **headers}
        if name is not None:
            key = os.environ.get(name, "")
            if not key:
                raise Failure(f"the judge's API key variable {name} is not set (or empty)")
            if not (key.isascii() and key.isprintable()):  # httpx would fail on it, in words that say nothing
                raise Failure(f"the judge's API key variable {name} holds characters a header cannot carry")
            headers["authorization"] = f"Bearer {key}"
            secrets.append(key)
        return headers, Scrubber(secrets)

    def _body(self, rubric: Rubric, task: Mapping[str, Any], trajectory: Any) -> bytes:
        config = self.config
        try:
            messages = build_messages(rubric, task, trajectory)
        except ValueError as exc:
            raise Failure(str(exc)) from None
        request: dict[str, Any] = {
            "model": config.model,
            "messages": messages,
            "temperature": config.temperature,
            "max_tokens": config.max_tokens,
        }
        if config.response_format:
            request["response_format"] = {"type": "json_object"}
        return orjson.dumps(request)

    async def _count(self, accounts: tuple[Usage, ...], attempt: int) -> None:
        """Before each try of a request: count it (and a retry), and wait for the rate limit."""
        if attempt > 1:
            for account in accounts:
                account.retries += 1
        if self._meter.rate is not None:
            with waiting():  # the judge's quota is a limit: time queued for it is waiting, not judging
                await self._meter.rate.acquire()  # every request counts against the quota, retries too
        for usage in accounts:
            usage.requests += 1

    async def grade(
        self, rubric: Rubric, task: Mapping[str, Any], trajectory: Any, *, usage: Usage | None = None
    ) -> float:
        """The item's score on ``rubric``, normalised to 0..1; raises ``Failure``.

        ``usage``, if given, is charged with this call's cost as well as the judge's own total.
        """
        ref = rubric.ref
        body = self._body(rubric, task, trajectory)
        headers, scrub = self._headers(ref)
        accounts = (self._usage,) if usage is None else (self._usage, usage)
        try:
            async with held(self._meter.slots):  # queued behind the judge's max_concurrency: waiting
                response = await self._post(body, headers, scrub, functools.partial(self._count, accounts))
        except Failure as exc:  # the POST's
            reason = f"judge request failed: {exc.reason}"
            # the cause is what really failed (the last try's error), not tenacity's wrapper of it
            raise Failure(reason if scrub is None else scrub(reason), timed_out=exc.timed_out) from exc.__cause__
        # every message below quotes the reply: without the key in it, if it echoed the key
        content = response.content if scrub is None else scrub.body(response.content)
        if not response.is_success:
            raise Failure(f"judge answered HTTP {response.status_code}: {excerpt(content)!r}")
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError:
            raise Failure(f"judge response is not JSON: {excerpt(content)!r}") from None
        if isinstance(data, dict):
            for account in accounts:
                account.add(data.get("usage"))
        try:
            return parse_score(reply_content(data), rubric.scale)
        except ValueError as exc:
            raise Failure(str(exc)) from None
