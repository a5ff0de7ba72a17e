"""The LLM judge: the client that grades one item against one rubric through any OpenAI-compatible chat API.

Its strict reading of replies, its limits, retries and secrets: docs/design.md, The judge.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import anyio
import httpx
import orjson

from engine._config import JudgeConfig, Limits
from engine._core.meters import Meter, held, rate, waiting
from engine._core.window import Window
from engine._errors import Failure, Overspent
from engine._http.headers import fill_headers
from engine._http.post import Post
from engine._http.retry import RETRY_STATUSES, Sleep
from engine._reasons import Scrubber, excerpt
from engine._verifiers.rubric.budget import Budget
from engine._verifiers.rubric.prompt import build_messages, parse_score, reply_content
from engine._verifiers.rubric.registry import Rubric

__all__ = ["JUDGE_RETRY_STATUSES", "Judge", "Usage"]

# 429 and every 5xx: a judge behind a gateway answers 500 for an overloaded model as often as 503.
JUDGE_RETRY_STATUSES = RETRY_STATUSES | frozenset(range(500, 600))


@dataclass
class Usage:
    """What judging cost: requests sent (retries among them) and tokens, as the replies report them.

    Add a reply's ``usage`` object with :meth:`add`.
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

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


# identity: a compressed reply could inflate past max_body after the transport has checked it
_HEADERS = {"content-type": "application/json", "accept": "application/json", "accept-encoding": "identity"}


class Judge:
    """A judge model behind an OpenAI-compatible API, with its own limits.

    One judge serves every rubric of an engine; each rubric's verifier keeps its own cost accounting (a batch's),
    its ``budget`` the engine's (``refs``: the config's refs tables, where a rubric's own budget is).
    ``sleep`` is what retries wait with.
    """

    def __init__(
        self,
        config: JudgeConfig,
        client: httpx.AsyncClient,
        *,
        sleep: Sleep = anyio.sleep,
        refs: Mapping[str, Limits] | None = None,
    ) -> None:
        self.config = config
        self.budget = Budget(config, refs or {})  # the engine's: its rubrics' budgets are in its refs tables
        # one window for every rubric: the quota is the API's (a Retry-After pauses no longer than a retry may wait)
        self.window = Window(config.max_concurrency, longest_pause=config.retry_deadline, sleep=sleep)
        self._meter = Meter(self.window, rate(config.max_rate) if config.max_rate is not None else None, self.window)
        self._post = Post(
            config.url, client, config, sleep=sleep, retry_statuses=JUDGE_RETRY_STATUSES, window=self.window
        )

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

    async def _count(self, usage: Usage, key: str, attempt: int) -> None:
        """Before each try of a request: count it (and a retry), wait for the rate limit, and send none past a
        budget (``Overspent``; checked last, as the request goes: a reply may have crossed it meanwhile)."""
        if attempt > 1:
            usage.retries += 1
        if self._meter.rate is not None:
            with waiting():  # the judge's quota is a limit: time queued for it is waiting, not judging
                await self._meter.rate.acquire()  # every request counts against the quota, retries too
        self.budget.check(key)
        usage.requests += 1

    def request_body(self, rubric: Rubric, task: Mapping[str, Any], trajectory: Any) -> bytes:
        """The exact body :meth:`grade` sends for the item: what decides its verdict (the cache's key); ``Failure``."""
        return self._body(rubric, task, trajectory)

    async def grade(
        self, rubric: Rubric, task: Mapping[str, Any], trajectory: Any, *, usage: Usage | None = None,
        body: bytes | None = None,
    ) -> float:
        """The item's score on ``rubric``, normalised to 0..1; raises ``Failure``.

        ``usage``, if given, is charged with this call's cost (requests, retries, tokens); ``body``, if given, is
        the item's :meth:`request_body`, made already.
        """
        ref = rubric.ref
        key = f"{rubric.owner}/{rubric.name}"  # a budget's rubric: every version's
        if body is None:
            body = self._body(rubric, task, trajectory)
        headers, scrub = self._headers(ref)
        account = Usage() if usage is None else usage
        try:
            async with held(self._meter.slots):  # queued behind the judge's max_concurrency: waiting
                response = await self._post(body, headers, scrub, functools.partial(self._count, account, key))
        except Overspent:  # no request sent: the budget's words, as they are
            raise
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
        reported = data.get("usage") if isinstance(data, dict) else None
        account.add(reported)
        self.budget.charge(key, reported)  # before the score is read: a reply without one cost tokens too
        try:
            return parse_score(reply_content(data), rubric.scale)
        except ValueError as exc:
            raise Failure(str(exc)) from None
