"""OpenRLHF 0.11.2's own reward-calling code, unmodified, against the adapter file and ``engine serve``.

Its rollout actors (``RolloutRayActor``, vLLM replaced by a scripted engine: ``openrlhf_support``) run as
Ray actors on a local Ray, fed by its ``SamplesGenerator``; its ``SingleTurnAgentExecutor`` calls the
adapter file (``--reward.remote_url /path/to/openrlhf.py``) or ``POST /get_reward`` with its own retries;
its ``RemoteExperienceMaker`` turns the rewards into advantages. Its own argument parser reads the
example's launch line and every launch line of ``docs/trainers/openrlhf.md``. Run in the OpenRLHF venv:

    ENGINE_TRAINER=openrlhf PYTHONPATH=$PWD/tests/trainers/standins/openrlhf \\
        .venv-openrlhf/bin/python -m pytest -q tests/trainers/test_openrlhf.py
"""

from __future__ import annotations

import asyncio
import collections
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from conftest import add_env
from polling import wait_until

import engine

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "examples" / "trainers")]

import openrlhf_ppo as example  # noqa: E402
import openrlhf_support as orl  # noqa: E402
from test_serve import Service, servable, start_service, stop  # noqa: E402

ADAPTER = str(ROOT / "engine" / "adapters" / "openrlhf.py")
EXAMPLES = ROOT / "examples"
DOCS = ROOT / "docs" / "trainers" / "openrlhf.md"
STANDINS = HERE / "standins" / "openrlhf"
ERROR_LINE = "engine: OpenRLHF's reward_func failed"  # what docs/trainers/openrlhf.md tells users to look for
POOL = min(32, (os.cpu_count() or 1) + 4)  # asyncio.to_thread's pool: reward_func calls in flight per actor

COUNTED = '''
import os


def score(task, trajectory):
    with open(task["log"], "a") as log:  # one line per call: the tests count the verifier's calls
        log.write(task["reference"] + "\\n")
    if task["reference"] == "boom":
        raise ValueError("boom is no reference")
    return 1.0 if trajectory.strip() == task["reference"] else 0.0
'''

pytestmark = [
    pytest.mark.timeout(600),
    # OpenRLHF's imports (torch.jit, deepspeed, transformers) warn about their own deprecations: not ours
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                               "ignore::UserWarning", "ignore::pytest.PytestUnraisableExceptionWarning"),
]


# --- fixtures: a local Ray, environments, engine serve ---------------------------------------------------


@pytest.fixture(scope="module")
def ray_local() -> Iterator[Path]:
    """A local Ray whose workers import the tests' modules and the stand-ins; its temp dir (worker logs)."""
    import ray

    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths have a length limit
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(HERE), str(STANDINS), os.environ.get("PYTHONPATH", "")])
    ray.init(address="local", include_dashboard=False, num_cpus=2, _temp_dir=str(temp), log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    try:
        yield temp
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def tok() -> Any:
    return orl.tokenizer()


@pytest.fixture(scope="module")
def module_envs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/envs and ``counted`` (a plugin logging each call to ``task["log"]``, failing ``boom``)."""
    root = tmp_path_factory.mktemp("orl")
    envs = root / "envs"
    shutil.copytree(ROOT / "tests" / "envs", envs, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    servable(envs)
    add_env(envs, "counted", "plugin", "verify:score")
    (envs / "counted" / "verify.py").write_text(COUNTED)
    (root / "engine.toml").write_text(f'environments = "{envs}"\nallow_unpinned = true\n')
    return root


@pytest.fixture(scope="module")
def serve(module_envs: Path) -> Iterator[Service]:
    """``engine serve`` over the module's environments, ``arith`` for labels that are references."""
    service = start_service(module_envs, "", "--environment", "arith")
    try:
        yield service
    finally:
        stop(service)


def actors(count: int, url: str, responses: dict[str, str], tok: Any, **env: str) -> list[Any]:
    """``count`` OpenRLHF rollout actors (vLLM scripted) calling ``url``, with ``env`` in their processes."""
    import ray

    remote = ray.remote(num_cpus=0)(orl.Rollout)
    made = [remote.options(runtime_env={"env_vars": env}).remote([url], responses, tok) for _ in range(count)]
    ray.get([actor.engine_batches.remote() for actor in made])  # started (a failure to start raises here)
    return made


def counted_label(reference: str, log: Path) -> str:
    return orjson.dumps({"environment": "counted", "task": {"reference": reference, "log": str(log)}}).decode()


def metric(service: Service, name: str, **labels: str) -> float:
    wanted = tuple(sorted(labels.items()))
    return sum(value for (sample, got), value in service.metrics().items()
               if sample in (name, name + "_total") and got == wanted)


def text_of(trajectory: Any) -> str:
    """What the model said in an example rollout's trajectory (a string, a message, or messages)."""
    if isinstance(trajectory, str):
        return trajectory
    if isinstance(trajectory, dict):
        return str(trajectory["content"])
    return str([m for m in trajectory if m["role"] == "assistant"][-1]["content"])


def worker_log(temp: Path, actor: Any, suffix: str) -> str:
    import ray

    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    return "".join(path.read_text(errors="replace") for path in temp.glob(f"session_*/logs/worker-*-{pid}.{suffix}"))


# --- the launch lines --------------------------------------------------------------------------------------


def test_the_examples_launch_line_is_read_by_openrlhfs_own_parser_and_dataset(tmp_path: Path, tok: Any,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The keys are OpenRLHF's own (``--data.input_key`` a top-level column), the labels the example's items."""
    prompts = tmp_path / "prompts.jsonl"
    monkeypatch.setattr(example, "PROMPTS", prompts)
    example.write_prompts(EXAMPLES / "rollouts.jsonl", prompts)
    args = orl.parse_launch(example.launch_line(ADAPTER))
    assert args.reward.remote_url == [ADAPTER] and (args.data.input_key, args.data.label_key) == ("prompt", "label")
    dataset = orl.prompts_dataset(args, tok)
    rows = [orjson.loads(line) for line in (EXAMPLES / "rollouts.jsonl").read_bytes().splitlines()][:64]
    assert len(dataset) == 64 == args.data.max_samples
    assert [dataset[n][1] for n in range(64)] == [row["task"]["prompt"] for row in rows]
    assert [orjson.loads(dataset[n][2]) for n in range(64)] == [
        {"environment": row["environment"], "task": row["task"], "id": row["id"]} for row in rows]


def test_the_old_examples_flags_are_rejected_by_openrlhf(capsys: pytest.CaptureFixture[str]) -> None:
    """What the example said before: OpenRLHF 0.11.2's parser knows none of these flags."""
    with pytest.raises(SystemExit) as exited:
        orl.parse_launch(["--pretrain", "m", "--prompt_data", "p.jsonl", "--input_key", "task.prompt"])
    assert exited.value.code == 2
    said = capsys.readouterr().err
    assert "unrecognized arguments: --pretrain m --prompt_data p.jsonl --input_key task.prompt" in said


def doc_commands() -> list[list[str]]:
    """Every command line in the page's shell code blocks (continuations joined), as words."""
    lines = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", DOCS.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            lines.append(shlex.split(line.replace('"$(engine adapters openrlhf-path)"', ADAPTER)))
    return [words for words in lines if words]


def test_every_command_of_the_docs_page_is_read_by_its_own_parser() -> None:
    """OpenRLHF's launch lines by OpenRLHF's parser; ``engine serve`` by the engine's; nothing else is there."""
    from engine.cli import cli

    launches = serves = 0
    for words in doc_commands():
        if words[:1] == ["export"]:
            assert words[1].split("=")[0] in ("ENGINE_CONFIG", "ENGINE_URL", "ENGINE_TOKEN", "ENGINE_ENVIRONMENT")
        elif "openrlhf.cli.train_ppo_ray" in words:
            args = orl.parse_launch(words[words.index("openrlhf.cli.train_ppo_ray") + 1:])
            for url in args.reward.remote_url:
                assert url == ADAPTER or re.fullmatch(r"http://127\.0\.0\.1:\d+/get_reward", url), url
            launches += 1
        else:
            assert words[:2] == ["engine", "serve"], words
            serve = cli.get_command(None, "serve")  # type: ignore[arg-type]
            assert serve is not None and serve.make_context("serve", words[2:]).params["environment"]
            serves += 1
    assert (launches, serves) == (2, 1)


# --- the file path, through OpenRLHF's actors ---------------------------------------------------------------


def test_the_example_through_openrlhfs_actors_gets_each_samples_own_reward(
    ray_local: Path, tmp_path: Path, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example's rollouts (those of its plugin environments) as OpenRLHF trains on them: 64 prompts x 4
    samples over two rollout actors, each sample's reward what the engine gives its item alone; then
    OpenRLHF's experience maker shapes them. Prints how many engine batches the 256 samples made."""
    import ray

    rollouts = tmp_path / "rollouts.jsonl"
    rows = [orjson.loads(line) for line in (EXAMPLES / "rollouts.jsonl").read_bytes().splitlines()]
    rows = [row for row in rows if row["environment"] in ("arithmetic", "math")][:64]  # keywords: a service's
    rollouts.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    prompts = tmp_path / "prompts.jsonl"
    monkeypatch.setattr(example, "PROMPTS", prompts)
    example.write_prompts(rollouts, prompts)
    args = orl.parse_launch(example.launch_line(ADAPTER))
    dataset = orl.prompts_dataset(args, tok)
    responses = {}
    for row in rows:
        responses.setdefault(row["task"]["prompt"], text_of(row["trajectory"]))

    async def alone() -> dict[str, float]:  # each item scored by itself: what each sample must get
        async with engine.Engine(engine.load_config(EXAMPLES / "engine.toml")) as eng:
            return {r["id"]: (await eng.score([{"environment": r["environment"], "task": r["task"],
                                                "trajectory": responses[r["task"]["prompt"]]}]))[0] for r in rows}

    expected = asyncio.run(alone())
    assert 0 < sum(expected.values()) < len(expected)  # right and wrong answers both: a swap would show
    rollers = actors(2, ADAPTER, responses, tok, ENGINE_CONFIG=str(EXAMPLES / "engine.toml"))
    experiences = orl.generate(args, rollers, dataset, tok)
    assert len(experiences) == 64 * 4
    got = collections.Counter((orjson.loads(e.labels[0])["id"], e.rewards.item()) for e in experiences)
    assert got == collections.Counter({(ident, reward): 4 for ident, reward in expected.items()})
    batches = sum(ray.get([a.engine_batches.remote() for a in rollers]))
    print(f"\n[openrlhf file path] 256 samples, 2 rollout actors, pool {POOL}: {batches} engine batches")
    assert math.ceil(256 / POOL) <= batches <= 256  # at most the pool's calls in flight per actor: never one batch

    maker = orl.experience_maker(args, tok)
    samples = maker.split_rollout_samples(experiences)
    import torch

    for sample in samples:  # what make_experience attaches (the models' forward passes), zeros here
        sample.kl = torch.zeros_like(sample.action_mask, dtype=torch.float32)
    shaped = maker.compute_advantages_and_returns(samples)
    assert all(torch.isfinite(s.advantages).all() for s in shaped)
    assert sorted(s.info["reward"].item() for s in shaped) == sorted(e.rewards.item() for e in experiences)


def test_a_failure_on_the_file_path_is_an_error_line_and_never_a_number(
    ray_local: Path, module_envs: Path, tmp_path: Path, tok: Any
) -> None:
    """OpenRLHF records None for the failed sample (logging it at INFO on stdout) and its experience maker
    stops on it later; the engine's ERROR line is in the actor's stderr, naming the verifier and why."""
    log = tmp_path / "calls"
    prompts = [f"Q{n}: " for n in range(4)]
    labels = [counted_label(str(n), log) for n in range(3)] + [counted_label("boom", log)]
    args = orl.parse_launch(_line(tmp_path, prompts, labels))
    dataset = orl.prompts_dataset(args, tok)
    rollers = actors(1, ADAPTER, {p: str(n) for n, p in enumerate(prompts)}, tok,
                     ENGINE_CONFIG=str(module_envs / "engine.toml"))
    experiences = orl.generate(args, rollers, dataset, tok)
    by_prompt = {e.prompts[0]: e.rewards for e in experiences}
    assert by_prompt["Q3: "] is None
    assert {p: r.item() for p, r in by_prompt.items() if r is not None} == {"Q0: ": 1.0, "Q1: ": 1.0, "Q2: ": 1.0}

    def logged() -> bool:
        return ERROR_LINE in worker_log(ray_local, rollers[0], "err")

    wait_until(logged, 60, "the engine's ERROR line never reached the actor's stderr")
    line = next(line for line in worker_log(ray_local, rollers[0], "err").splitlines() if ERROR_LINE in line)
    assert "VerificationError" in line and "counted" in line and "boom is no reference" in line
    assert "[SingleTurnExecutor] Failed to fetch reward" in worker_log(ray_local, rollers[0], "out")  # INFO, stdout
    maker = orl.experience_maker(args, tok)
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute"):  # OpenRLHF's crash, later
        maker.compute_advantages_and_returns(maker.split_rollout_samples(experiences))


def _line(tmp_path: Path, prompts: list[str], labels: list[str], url: str = ADAPTER) -> list[str]:
    """A launch line over a prompt file of ``prompts`` and ``labels`` (one sample each, as small as it validates)."""
    rows = [{"prompt": p, "label": lab} for p, lab in zip(prompts, labels, strict=True)]
    path = orl.write_prompts(tmp_path / "p.jsonl", rows)
    return ["--reward.remote_url", url, "--data.prompt_dataset", str(path), "--data.input_key", "prompt",
            "--data.label_key", "label", "--algo.advantage.estimator", "reinforce", "--rollout.batch_size",
            str(len(prompts)), "--rollout.micro_batch_size", "4", "--actor.num_gpus_per_node", "1"]


# --- two callers, in one process (finding 6) --------------------------------------------------------------


def test_of_two_concurrent_callers_only_the_failing_one_fails(
    module_envs: Path, tmp_path: Path, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenRLHF's own ``generate_responses`` for two prompts at once on one actor's loop, 30 times: their
    ``reward_func`` calls are gathered into one engine batch, and only the failing prompt's sample fails."""
    from vllm import SamplingParams

    from engine.adapters import close_engines

    monkeypatch.setenv("ENGINE_CONFIG", str(module_envs / "engine.toml"))
    log = tmp_path / "calls"
    rollout = orl.Rollout([ADAPTER], {"good: ": "1", "bad: ": "x"}, tok)

    async def rounds() -> list[tuple[Any, Any]]:
        out = []
        for _ in range(30):
            good, bad = await asyncio.gather(
                rollout.generate_responses("good: ", counted_label("1", log), SamplingParams(), 64, tok),
                rollout.generate_responses("bad: ", counted_label("boom", log), SamplingParams(), 64, tok),
            )
            out.append((good[0]["reward"], bad[0]["reward"]))
        return out

    try:
        results = asyncio.run(rounds())
    finally:
        close_engines()
    assert results == [([1.0], None)] * 30


# --- the HTTP path: engine serve and OpenRLHF's retrying client -------------------------------------------


def test_a_failure_over_http_is_scored_once_though_openrlhf_asks_five_times(
    ray_local: Path, serve: Service, tmp_path: Path, tok: Any
) -> None:
    """OpenRLHF posts a failed /get_reward 5 times, a second apart; the verifier runs once, the other 4 are
    answered from the failure. The sample's reward is None (OpenRLHF's), the others' their own."""
    url = serve.url + "/get_reward"
    log = tmp_path / "calls"
    prompts = [f"Q{n}: " for n in range(4)]
    labels = [counted_label(str(n), log) for n in range(3)] + [counted_label("boom", log)]
    args = orl.parse_launch(_line(tmp_path, prompts, labels, url))
    dataset = orl.prompts_dataset(args, tok)
    before_422 = metric(serve, "engine_http_requests", route="/get_reward", status="422")
    before_replayed = metric(serve, "engine_get_reward_replayed")
    rollers = actors(1, url, {p: str(n) if n != 1 else "7" for n, p in enumerate(prompts)}, tok)
    experiences = orl.generate(args, rollers, dataset, tok)
    by_prompt = {e.prompts[0]: e.rewards for e in experiences}
    assert by_prompt["Q3: "] is None
    assert {p: r.item() for p, r in by_prompt.items() if r is not None} == {"Q0: ": 1.0, "Q1: ": 0.0, "Q2: ": 1.0}
    assert metric(serve, "engine_http_requests", route="/get_reward", status="422") - before_422 == 5
    assert metric(serve, "engine_get_reward_replayed") - before_replayed == 4
    assert log.read_text().splitlines().count("boom") == 1  # the verifier ran once for the 5 requests


def test_a_failed_request_sent_again_with_other_bytes_is_scored_again(serve: Service, tmp_path: Path) -> None:
    """Only a byte-identical body is answered from the failure: another request is the engine's to score."""
    log = tmp_path / "calls"
    body = {"query": ["P: x"], "prompts": ["P: "], "labels": [counted_label("boom", log)]}
    first = httpx.post(serve.url + "/get_reward", content=orjson.dumps(body), timeout=60)
    again = httpx.post(serve.url + "/get_reward", content=orjson.dumps(body), timeout=60)
    other = httpx.post(serve.url + "/get_reward", content=orjson.dumps(body) + b" ", timeout=60)
    assert first.status_code == again.status_code == other.status_code == 422
    assert first.content == again.content and first.json()["error"]["environment"] == "counted"
    assert log.read_text().splitlines() == ["boom", "boom"]  # the first and the other, not the one sent again


def test_256_samples_over_http_through_openrlhfs_actors(ray_local: Path, serve: Service, tmp_path: Path,
                                                        tok: Any) -> None:
    """Two steps of 64 prompts x 4 samples over two actors: every sample its own reward; prints how many engine
    batches each step made (engine serve gathers a plugin's requests once it has measured the plugin)."""
    prompts = [f"What is {n} + {n}? " for n in range(64)]
    labels = [str(2 * n) for n in range(64)]
    responses = {p: str(2 * n) if n % 3 else "wrong" for n, p in enumerate(prompts)}
    url = serve.url + "/get_reward"
    argv = [*_line(tmp_path, prompts, labels, url), "--rollout.n_samples_per_prompt", "4"]
    args = orl.parse_launch(argv)
    dataset = orl.prompts_dataset(args, tok)
    rollers = actors(2, url, responses, tok)
    for step in (1, 2):
        requests = metric(serve, "engine_http_requests", route="/get_reward", status="200")
        gathered = metric(serve, "engine_gathered_requests")
        batches = metric(serve, "engine_gathered_batches")
        experiences = orl.generate(args, rollers, dataset, tok)
        assert len(experiences) == 256
        assert collections.Counter((e.prompts[0], e.rewards.item()) for e in experiences) == collections.Counter(
            {(p, 0.0 if n % 3 == 0 else 1.0): 4 for n, p in enumerate(prompts)})
        requests = metric(serve, "engine_http_requests", route="/get_reward", status="200") - requests
        gathered = metric(serve, "engine_gathered_requests") - gathered
        shared = metric(serve, "engine_gathered_batches") - batches
        assert requests == 256
        print(f"\n[openrlhf http path] step {step}: 256 requests, {requests - gathered + shared:.0f} engine batches "
              f"({gathered:.0f} requests gathered into {shared:.0f})")
