"""The judge's spend budgets, against a real OpenAI-compatible judge on 127.0.0.1 that reports each reply's usage.

Each reply to an item answering ``N`` costs ``100 + N`` prompt and 3 completion tokens (``usage_for``), so what a batch
spends is known item by item. The judge's ``max_concurrency = 1`` makes the reply that crosses a budget the one the
test names; dedup is off (``undeduped``) so that each of the repeated items is a call (with more in flight, the
replies already sent count too: docs/design.md, The judge).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest
from cli_support import invoke
from conftest import add_rubric_env
from servers import Server, score
from test_engine_rubric import ARITH, HELP, RUBRICS, by_response, engine_config, judge_config, judged
from test_serve import start_service, stop

import engine
from engine import BudgetError, ConfigError, Engine, Limits, VerificationError
from engine._config import config_from_mapping

ONE = 104  # tokens a reply to an item answering "1" costs: 101 in, 3 out
PRICES = {"price_per_million_input": 1000.0, "price_per_million_output": 2000.0}  # 0.001 and 0.002 a token
ONE_SPEND = 101 * 0.001 + 3 * 0.002  # 0.107


def undeduped(base_url: str, **settings: Any) -> Any:
    """A judge config that judges every item (``dedupe = false``): the items here repeat, and each is to cost."""
    return judge_config(base_url, dedupe=False, **settings)


@pytest.fixture
def judge() -> Any:
    with Server.judge(default=by_response) as server:
        yield server


def rubric_envs(envs: Path) -> None:
    add_rubric_env(envs, "arith_rubric", ARITH)
    add_rubric_env(envs, "help_rubric", HELP)


def ones(environment: str, count: int) -> list[dict[str, Any]]:
    return [judged(environment, "1", item_id=f"r{i}") for i in range(count)]


async def budget_error(eng: Engine, items: list[dict[str, Any]]) -> BudgetError:
    with pytest.raises(BudgetError) as info:
        await eng.run(items)
    return info.value


async def test_a_token_budget_crossed_mid_batch_aborts_it_and_the_next_batch_sends_nothing(
    judge: Server, envs: Path
) -> None:
    rubric_envs(envs)
    config = engine_config(envs, RUBRICS, undeduped(judge.base_url, max_concurrency=1, token_budget=250))
    async with Engine(config) as eng:
        error = await budget_error(eng, ones("arith_rubric", 5))
        # the third reply took it to 312 > 250: counted, and its item failed; the two before it were within it
        assert isinstance(error, VerificationError)
        assert (error.kind, error.key, error.index, error.item_id) == ("rubric", ARITH, 2, "r2")
        assert (error.budget, error.measure, error.limit, error.spent) == ("judge", "tokens", 250, 3 * ONE)
        assert "token budget of 250 is spent" in str(error)
        assert len(judge.requests) == 3

        again = await budget_error(eng, ones("arith_rubric", 3))  # the same engine: spent is its life's
        assert (again.index, again.spent) == (0, 3 * ONE)
        assert len(judge.requests) == 3  # nothing sent
        stats = eng.stats()
    assert stats[f"engine/{ARITH}/errors"] == 2.0


async def test_the_budget_is_the_engines_each_opening_starts_from_nothing(judge: Server, envs: Path) -> None:
    rubric_envs(envs)
    config = engine_config(envs, RUBRICS, undeduped(judge.base_url, max_concurrency=1, token_budget=250))
    async with Engine(config) as eng:
        assert await eng.score(ones("arith_rubric", 2)) == [0.1, 0.1]
    async with Engine(config) as eng:
        assert await eng.score(ones("arith_rubric", 2)) == [0.1, 0.1]
        await budget_error(eng, ones("arith_rubric", 1))


async def test_a_spend_budget_prices_tokens_and_stats_show_the_spend(judge: Server, envs: Path) -> None:
    rubric_envs(envs)
    settings = {"max_concurrency": 1, "spend_budget": 0.3, **PRICES}
    async with Engine(engine_config(envs, RUBRICS, undeduped(judge.base_url, **settings))) as eng:
        result = await eng.run(ones("arith_rubric", 2))
        assert result.verifiers[0].spent["spend"] == pytest.approx(2 * ONE_SPEND)
        assert result.usage["spend"] == pytest.approx(2 * ONE_SPEND)
        stats = eng.stats()
        assert stats[f"engine/{ARITH}/judge_spend"] == pytest.approx(2 * ONE_SPEND)
        assert stats[f"engine/{ARITH}/judge_tokens"] == 2 * ONE
        error = await budget_error(eng, ones("arith_rubric", 1))
    assert (error.budget, error.measure, error.limit) == ("judge", "spend", 0.3)
    assert error.spent == pytest.approx(3 * ONE_SPEND)
    assert "spend budget of 0.3 is spent" in error.reason


async def test_the_judges_budget_holds_over_every_rubric_and_a_rubrics_own_over_it_alone(
    judge: Server, envs: Path
) -> None:
    rubric_envs(envs)
    wide = undeduped(judge.base_url, max_concurrency=1, token_budget=300)
    async with Engine(engine_config(envs, RUBRICS, wide)) as eng:
        await eng.score(ones("arith_rubric", 1))
        await eng.score(ones("help_rubric", 1))  # 208: the judge's, both rubrics'
        error = await budget_error(eng, ones("arith_rubric", 1))
        assert (error.key, error.budget, error.spent) == (ARITH, "judge", 3 * ONE)
        other = await budget_error(eng, ones("help_rubric", 1))
        assert (other.key, other.budget, other.index) == (HELP, "judge", 0)
    assert len(judge.requests) == 3

    own = engine_config(envs, RUBRICS, undeduped(judge.base_url, max_concurrency=1),
                        refs={HELP: Limits(token_budget=150)})
    async with Engine(own) as eng:
        await eng.score(ones("help_rubric", 1))
        error = await budget_error(eng, ones("help_rubric", 2))
        assert (error.key, error.budget, error.measure, error.spent, error.index) == (HELP, HELP, "tokens", 2 * ONE, 0)
        assert await eng.score(ones("arith_rubric", 3)) == [0.1] * 3  # another rubric's budget is not its own
    assert f"rubric {HELP}'s token budget of 150" in error.reason


async def test_a_reply_without_usage_under_a_budget_fails_its_item_and_without_one_is_judged(envs: Path) -> None:
    rubric_envs(envs)
    with Server.judge(default=score(1)) as server:  # no usage in any reply
        config = engine_config(envs, RUBRICS, undeduped(server.base_url, token_budget=10_000))
        async with Engine(config) as eng:
            with pytest.raises(VerificationError) as info:
                await eng.run(ones("arith_rubric", 2))
        assert not isinstance(info.value, BudgetError)  # the budget is not spent: it cannot be kept
        assert "has no usage object" in info.value.reason and "judge's budget cannot be kept" in info.value.reason
        async with Engine(engine_config(envs, RUBRICS, undeduped(server.base_url))) as eng:
            assert await eng.score(ones("arith_rubric", 2)) == [0.1, 0.1]


async def test_a_lying_usage_counts_no_fewer_tokens_than_its_parts(envs: Path) -> None:
    rubric_envs(envs)
    lie = {"prompt_tokens": 200, "completion_tokens": 50, "total_tokens": 1}
    with Server.judge(default=score(1, usage=lie)) as server:
        config = engine_config(envs, RUBRICS, undeduped(server.base_url, max_concurrency=1, token_budget=300))
        async with Engine(config) as eng:
            error = await budget_error(eng, ones("arith_rubric", 3))
    assert (error.index, error.spent) == (1, 500)


JUDGE_TABLE = {"base_url": "http://127.0.0.1:9/v1", "model": "judge"}


@pytest.mark.parametrize(
    ("data", "key", "said"),
    [
        ({"judge": {**JUDGE_TABLE, "spend_budget": 5.0}}, "judge.spend_budget", "needs the judge's prices"),
        ({"judge": {**JUDGE_TABLE, "spend_budget": 5.0, "price_per_million_input": 1.0}},
         "judge.price_per_million_output", "both prices"),
        ({"judge": JUDGE_TABLE, "refs": {"acme/helpfulness": {"spend_budget": 1.0}}},
         "refs.'acme/helpfulness'.spend_budget", "needs the judge's prices"),
        ({"refs": {"acme/helpfulness": {"spend_budget": 1.0}}}, "refs.'acme/helpfulness'.spend_budget", "prices"),
        ({"judge": {**JUDGE_TABLE, "token_budget": -1}}, "judge.token_budget", "a whole number >= 1"),
        ({"judge": {**JUDGE_TABLE, "token_budget": 0}}, "judge.token_budget", "a whole number >= 1"),
        ({"judge": {**JUDGE_TABLE, "token_budget": 1.5}}, "judge.token_budget", "a whole number >= 1"),
        ({"judge": {**JUDGE_TABLE, **PRICES, "spend_budget": 0}}, "judge.spend_budget", "a number > 0"),
        ({"judge": {**JUDGE_TABLE, "price_per_million_input": -1.0, "price_per_million_output": 1.0}},
         "judge.price_per_million_input", "a number >= 0"),
        ({"judge": {**JUDGE_TABLE, "price_per_million_input": float("inf"), "price_per_million_output": 1.0}},
         "judge.price_per_million_input", "a number >= 0"),
        ({"judge": {**JUDGE_TABLE, "token_budgets": 5}}, "judge.token_budgets", "unknown key"),
        ({"defaults": {"token_budget": 5}}, "defaults.token_budget", "not [defaults]"),
        ({"refs": {"arith/verify:score": {"token_budget": 5}}}, "refs.'arith/verify:score'.token_budget",
         "only a rubric"),
        ({"refs": {"http://127.0.0.1:9/score": {"token_budget": 5}}}, "refs.'http://127.0.0.1:9/score'.token_budget",
         "only a rubric"),
        ({"refs": {"acme/helpfulness": {"token_budget": True}}}, "refs.'acme/helpfulness'.token_budget",
         "a whole number >= 1"),
    ],
)
def test_a_budget_the_engine_cannot_keep_is_a_config_error(data: dict[str, Any], key: str, said: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_mapping(data, base_dir=Path("."))
    assert info.value.key == key and said in info.value.problem


def test_a_token_budget_needs_no_prices_and_prices_need_no_budget() -> None:
    config = config_from_mapping({"judge": {**JUDGE_TABLE, "token_budget": 5, **PRICES},
                                  "refs": {"acme/helpfulness": {"token_budget": 3, "spend_budget": 0.5}}},
                                 base_dir=Path("."))
    assert config.judge is not None and config.judge.token_budget == 5 and config.judge.spend_budget is None
    assert config.refs["acme/helpfulness"].spend_budget == 0.5


def test_two_clients_of_engine_serve_share_one_budget_and_the_error_crosses_the_wire_as_itself(
    judge: Server, tmp_path: Path
) -> None:
    envs = tmp_path / "envs"
    envs.mkdir()
    rubric_envs(envs)
    shutil.copytree(RUBRICS, tmp_path / "rubrics")
    config = (f'rubrics = "rubrics"\n[judge]\nbase_url = "{judge.base_url}"\nmodel = "judge-test"\n'
              "max_concurrency = 1\ntoken_budget = 250\nprice_per_million_input = 1000.0\n"
              "price_per_million_output = 2000.0\n")
    service = start_service(tmp_path, config)
    try:
        with engine.BlockingEngine.connect(service.url) as first, engine.BlockingEngine.connect(service.url) as second:
            assert first.score(ones("arith_rubric", 1)) == [0.1]
            assert second.score(ones("arith_rubric", 1)) == [0.1]  # 208 of the one budget
            with pytest.raises(BudgetError) as info:
                first.score(ones("arith_rubric", 2))
            error = info.value
            assert (error.kind, error.key, error.index, error.item_id) == ("rubric", ARITH, 0, "r0")
            assert (error.budget, error.measure, error.limit, error.spent) == ("judge", "tokens", 250, 3 * ONE)
            with pytest.raises(BudgetError):  # the other client: the same budget, spent; nothing sent
                second.score(ones("arith_rubric", 1))
            assert len(judge.requests) == 3
            stats = second.stats()
            assert stats[f"engine/{ARITH}/judge_spend"] == pytest.approx(ONE_SPEND)  # its own batch's
        metrics = service.metrics()
        labels = {"kind": "rubric", "verifier": ARITH}
        spent = tuple(sorted({**labels, "what": "spend"}.items()))
        errors = tuple(sorted({**labels, "type": "BudgetError"}.items()))
        assert metrics[("engine_verifier_spent_total", spent)] == pytest.approx(2 * ONE_SPEND)
        assert metrics[("engine_verifier_errors_total", errors)] == 2
    finally:
        stop(service)


def test_a_budget_error_with_a_field_of_the_wrong_type_is_a_service_error() -> None:
    """A lying service's budget error is not taken at its word."""
    from engine._remote.wire import decode_error, encode_error

    fields = {"budget": "judge", "measure": "tokens", "limit": 5, "spent": 9}
    good = BudgetError("rubric", "a/b@1", "spent", key="a/b", **fields)
    body = encode_error(good)
    decoded = decode_error(422, orjson.dumps(body), "http://127.0.0.1:9")
    assert isinstance(decoded, BudgetError) and decoded.spent == 9 and decoded.key == "a/b"
    for name, value in (("measure", "dollars"), ("limit", "5"), ("spent", -1), ("budget", None)):
        wrong = {"error": {**body["error"], name: value}}
        assert isinstance(decode_error(422, orjson.dumps(wrong), "http://127.0.0.1:9"), engine.ServiceError), name
    missing = {"error": {k: v for k, v in body["error"].items() if k != "spent"}}
    assert isinstance(decode_error(422, orjson.dumps(missing), "http://127.0.0.1:9"), engine.ServiceError)


def test_engine_score_summary_shows_the_judges_tokens_and_spend(judge: Server, tmp_path: Path) -> None:
    envs = tmp_path / "envs"
    envs.mkdir()
    rubric_envs(envs)
    shutil.copytree(RUBRICS, tmp_path / "rubrics")
    (tmp_path / "engine.toml").write_text(
        f'environments = "envs"\nallow_unpinned = true\nrubrics = "rubrics"\n[judge]\nbase_url = "{judge.base_url}"\n'
        'model = "judge-test"\nprice_per_million_input = 1000.0\nprice_per_million_output = 2000.0\ndedupe = false\n')
    rows = b"".join(orjson.dumps(row) + b"\n" for row in ones("arith_rubric", 2))
    (tmp_path / "in.jsonl").write_bytes(rows)
    ran = invoke("score", "in.jsonl", "-o", "out.jsonl", "--config", "engine.toml", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    header = next(line for line in ran.stdout.splitlines() if "judge tokens" in line)
    assert "spend" in header
    row = next(line for line in ran.stdout.splitlines() if ARITH in line)
    assert f"{2 * ONE}" in row and f"{2 * ONE_SPEND:.6g}" in row


def test_a_state_file_without_spent_still_resumes_and_one_with_a_bad_spent_is_refused() -> None:
    from engine._core.report import VerifierTotals

    totals = VerifierTotals("rubric", "a/b@1", spent={"total_tokens": 5, "spend": 0.25})
    data = totals.to_json()
    assert VerifierTotals.from_json(data).spent == {"total_tokens": 5, "spend": 0.25}
    older = {k: v for k, v in data.items() if k != "spent"}
    assert VerifierTotals.from_json(older).spent == {}
    for bad in ({"spend": -1.0}, {"spend": "1"}, [1]):
        with pytest.raises(ValueError, match="spent"):
            VerifierTotals.from_json({**data, "spent": bad})


async def test_identical_items_deduped_cost_one_reply_of_the_budget(judge: Server, envs: Path) -> None:
    rubric_envs(envs)
    config = engine_config(envs, RUBRICS, judge_config(judge.base_url, max_concurrency=1, token_budget=ONE + 1))
    async with Engine(config) as eng:  # dedup on (the default): five identical items are one judge call
        assert await eng.score(ones("arith_rubric", 5)) == [0.1] * 5
        assert len(judge.requests) == 1
        stats = eng.stats()
    assert stats[f"engine/{ARITH}/judge_tokens"] == ONE
