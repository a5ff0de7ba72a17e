"""verl 0.9.1's own reward code, unmodified, calling ``engine.adapters.verl.compute_score`` as verl calls it.

verl's config is composed by its own hydra files (and, for the docs' and the example's launch lines, by
``python -m verl.trainer.main_ppo --cfg job``, its own entry point); its reward workers are verl's
``RewardLoopWorker`` Ray actors (made by ``RewardLoopManager`` on a local Ray of 2 CPUs), each running
verl's ``NaiveRewardManager``; samples come out of verl's ``AgentLoopWorker`` (its streaming path sends
each finished sample as one Ray call to a random reward worker) or are scored by
``RewardLoopManager.compute_rm_score`` (the batch path: the batch cut into one chunk per worker). The one
stand-in is generation (``verl_support.CannedAgentLoop``): no GPU, no model. Each way runs in process
(``config=``) and against a real ``engine serve`` (``url=``).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from shlex import quote as shlex_quote
from typing import Any

import pytest
import ray
import yaml
from cli_support import child_env, engine_command
from polling import wait_until
from verl import DataProto
from verl.trainer.ppo.reward import get_custom_reward_fn
from verl_support import (  # verl's Ray-using modules too: imported there, where a warning they give is filtered
    ADAPTER,
    AgentLoopWorker,
    NaiveRewardManager,
    RewardLoopManager,
    RewardLoopWorker,
    compose_verl,
    engine_reward,
    expected,
    float32,
    gen_batch,
    numbered,
    rewards_of,
    rows,
    settings,
    start_ray,
    worker_batches,
)

import engine

pytestmark = pytest.mark.timeout(600)  # verl's Ray workers start in ~30-60 s each on a loaded 2-core machine

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "trainers" / "verl.md"
EXAMPLE = ROOT / "examples" / "trainers" / "verl_ppo.py"
TOKEN = "verl-test-token"
WORKERS = 2  # reward workers of the tests' managers
# What the docs write where the user's own paths go
ADAPTER_PLACEHOLDER = "/path/to/engine/adapters/verl.py"
CONFIG_PLACEHOLDER = "/path/to/engine.toml"


# --- fixtures: one workspace, one Ray and one engine serve for the module; reward managers one way at a time ---


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from verl_support import workspace

    path = tmp_path_factory.mktemp("verl")
    workspace(path)
    return path


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    start_ray()
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def served(root: Path) -> Iterator[str]:
    """An ``engine serve`` over the workspace's environments, asking for ``TOKEN``; its URL."""
    import socket

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = engine_command("serve", "--config", root / "engine.toml", "--port", str(port),
                             "--token-env", "SERVE_TOKEN")
    log = (root / "serve.log").open("w")
    server = subprocess.Popen(command, cwd=root, env=child_env({"SERVE_TOKEN": TOKEN}), stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert server.poll() is None, "engine serve exited"
        try:
            return httpx.get(f"{url}/healthz", headers={"authorization": f"Bearer {TOKEN}"}, timeout=5).is_success
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, 60, "engine serve never answered /healthz")
        yield url
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def config_for(root: Path, way: str, url: str | None = None, workers: int = WORKERS) -> Any:
    """verl's config with the engine as its reward function: ``config=`` the workspace's file, or ``url=``."""
    kwargs = {"config": str(root / "engine.toml")} if way == "config" else {"url": url, "token": TOKEN}
    return compose_verl([*settings(root, workers), *engine_reward(**kwargs)])


@pytest.fixture(scope="module", params=["config", "url"])
def manager(request: pytest.FixtureRequest, root: Path, ray_cluster: None, served: str) -> Iterator[RewardLoopManager]:
    """verl's ``RewardLoopManager`` and its ``WORKERS`` reward workers (Ray actors), calling the engine
    in process (``config``) or through ``engine serve`` (``url``): one way at a time, as verl names its
    workers ``reward_loop_worker_<i>`` (pytest runs every test of one way before the other's)."""
    built = RewardLoopManager(config_for(root, request.param, served))
    worker_batches(built.reward_loop_workers)  # started: each has built its reward manager
    yield built
    for handle in built.reward_loop_workers:
        ray.kill(handle)

    def gone() -> bool:
        try:
            ray.get_actor("reward_loop_worker_0")
        except ValueError:
            return True
        return False

    wait_until(gone, 60, "verl's reward workers never went")


def agent_worker(config: Any, handles: list[Any] | None) -> AgentLoopWorker:
    """verl's ``AgentLoopWorker`` (in this process: it only sends Ray calls), streaming each finished sample
    to ``handles`` (a random one each) when given, or leaving the rewards to the batch path."""
    return AgentLoopWorker(config, None, None, handles)


def streamed(manager: RewardLoopManager, samples: list[dict[str, Any]], handles: list[Any] | None = None) -> DataProto:
    """``samples`` through verl's streaming path: generated, each scored by one Ray call as it finishes."""
    worker = agent_worker(manager.config, handles or manager.reward_loop_workers)
    return asyncio.run(worker.generate_sequences(gen_batch(rows(samples))))


def generated(manager: RewardLoopManager, samples: list[dict[str, Any]]) -> DataProto:
    """``samples`` generated, without rewards: what verl's batch path hands ``compute_rm_score``."""
    return asyncio.run(agent_worker(manager.config, None).generate_sequences(gen_batch(rows(samples))))


def batch_path(manager: RewardLoopManager, samples: list[dict[str, Any]]) -> list[float]:
    output = generated(manager, samples)
    assert "rm_scores" not in output.batch.keys()  # noqa: SIM118  # a TensorDict refuses `in` itself
    return rewards_of(output.union(manager.compute_rm_score(output)))


def raised(call: Callable[[], Any]) -> BaseException:
    try:
        call()
    except BaseException as exc:  # what verl raises, whatever it is, is the test's subject
        return exc
    raise AssertionError("nothing was raised: a failure became a number")


# --- the configuration: what verl reads --------------------------------------------------------------------


def fenced(language: str) -> list[str]:
    """The docs page's fenced ``language`` blocks."""
    return re.findall(rf"^```{language}\n(.*?)^```", DOC.read_text(), flags=re.M | re.S)


def filled(text: str, root: Path) -> str:
    assert ADAPTER_PLACEHOLDER in text or "engine.adapters.verl" in text, text
    return text.replace(ADAPTER_PLACEHOLDER, ADAPTER).replace(CONFIG_PLACEHOLDER, str(root / "engine.toml"))


def main_ppo_job(arguments: list[str], cwd: Path) -> subprocess.Popen[str]:
    """``python -m verl.trainer.main_ppo ARGUMENTS --cfg job``: verl's own entry point, which composes the
    config and prints it (hydra's ``--cfg job``) instead of training."""
    return subprocess.Popen([sys.executable, "-m", "verl.trainer.main_ppo", *arguments, "--cfg", "job"], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (ROOT, ROOT / "tests")))})


def printed_config(process: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    parsed: dict[str, Any] = yaml.safe_load(out)
    return parsed


def bash_launch_lines() -> list[str]:
    return [block for block in fenced("bash") if "verl.trainer.main_ppo" in block]


def test_every_launch_line_and_yaml_in_the_docs_and_the_example_is_what_verl_reads(root: Path) -> None:
    """verl's entry point composes each; the composed config hands ``compute_score`` the engine's config (the
    README's ``reward.reward_kwargs`` handed it nothing: finding 2)."""
    import importlib.util

    launches, files = bash_launch_lines(), fenced("yaml")
    assert launches and files
    jobs = []
    for n, block in enumerate(launches):
        # bash runs the block as written ($(...) and quotes included); its python, told to run verl's entry
        # point, prints the arguments it was given instead
        shim = ('python() { if [ "$1 $2" = "-m verl.trainer.main_ppo" ]; then shift 2; printf "%s\\n" "$@"; '
                f'else {shlex_quote(sys.executable)} "$@"; fi; }}\n')
        words = subprocess.run(["bash", "-c", shim + filled(block, root)], capture_output=True, text=True,
                               check=True, env=child_env(None))
        jobs.append((f"bash block {n}", main_ppo_job(words.stdout.splitlines(), root)))
    for n, block in enumerate(files):
        directory = root / f"doc-config-{n}"
        directory.mkdir()
        (directory / "engine_ppo.yaml").write_text(filled(block, root))  # the block is the whole file
        jobs.append((f"yaml block {n}", main_ppo_job(["--config-path", str(directory), "--config-name", "engine_ppo"],
                                                     root)))
    spec = importlib.util.spec_from_file_location("verl_ppo_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    line = example.launch_line(root / "train.parquet", root / "engine.toml", str(root / "tiny-model"))
    assert line[1:3] == ["-m", "verl.trainer.main_ppo"]
    jobs.append(("the example", main_ppo_job(line[3:], root)))
    try:
        for what, job in jobs:
            reward = printed_config(job)["reward"]
            assert reward["custom_reward_function"]["path"] == ADAPTER, what
            assert reward["custom_reward_function"]["name"] == "compute_score", what
            assert reward["custom_reward_function"]["reward_kwargs"] == {"config": str(root / "engine.toml")}, what
            assert "reward_kwargs" not in reward, what  # not where verl never looks
    finally:
        for _, job in jobs:  # those a failed assertion left running
            if job.poll() is None:
                job.kill()
            job.communicate()
    # and what verl builds from the example's line scores each sample through the engine
    config = compose_verl([*line[3:], *settings(root, 1)[1:]])  # settings' first is the model: the line has it
    assert get_custom_reward_fn(config).args[1] == {"config": str(root / "engine.toml")}
    samples = numbered(6)
    assert [outcome["reward_score"] for outcome in score_in_process(config, samples)] == expected(samples)


def test_without_its_plus_verl_refuses_the_reward_kwargs_key_at_launch(root: Path) -> None:
    """verl's own config has no ``reward_kwargs`` key: hydra refuses to set it unless the launch line adds it."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose_verl([*settings(root, 1), f"reward.custom_reward_function.reward_kwargs.config={root}/engine.toml"])


def in_process_worker(config: Any) -> RewardLoopWorker:
    """verl's ``RewardLoopWorker`` built in this process (the class its Ray actors are)."""
    return RewardLoopWorker(config)


def score_in_process(config: Any, samples: list[dict[str, Any]]) -> list[Any]:
    """Each sample's outcome as verl's reward worker computes it, every sample its own concurrent call."""

    async def run() -> list[Any]:
        worker = in_process_worker(config)
        assert type(worker.reward_manager) is NaiveRewardManager  # verl's default, reward_manager.name=naive
        output = await agent_worker(config, None).generate_sequences(gen_batch(rows(samples)))
        calls = [worker.compute_score(output[i : i + 1]) for i in range(len(output))]
        return list(await asyncio.gather(*calls, return_exceptions=True))

    return asyncio.run(run())


def test_the_readmes_reward_kwargs_are_never_read_and_every_call_fails_never_a_number(root: Path) -> None:
    """Where the README put them (``reward.reward_kwargs``) verl hands ``compute_score`` no keyword: each
    call raises, naming what to configure; none is scored."""
    config = compose_verl([*settings(root, 1), *engine_reward(), f"+reward.reward_kwargs.config={root}/engine.toml"])
    assert get_custom_reward_fn(config).args[1] == {}
    outcomes = score_in_process(config, numbered(3))
    assert all(isinstance(o, ValueError) and "no engine configured" in str(o) for o in outcomes), outcomes


def test_the_documented_config_scores_each_sample_in_verls_reward_worker(root: Path) -> None:
    samples = numbered(12)
    assert score_in_process(config_for(root, "config"), samples) == [
        {"reward_score": reward, "reward_extra_info": {"acc": reward}} for reward in expected(samples)
    ]


# --- verl's two paths on its Ray reward workers, in process and through engine serve ------------------------


def test_the_streaming_path_gets_each_samples_own_reward_in_order(manager: RewardLoopManager) -> None:
    """One Ray call per finished sample, to a random worker: verl hands ``compute_score`` an ``np.str_``
    data source and numpy integers in ``extra_info`` (``num_turns``), which ``url=`` refused (finding 3)."""
    samples = numbered(48)
    output = streamed(manager, samples)
    assert rewards_of(output) == float32(expected(samples))
    assert list(output.non_tensor_batch["acc"]) == expected(samples)


def test_the_batch_path_gets_each_samples_own_reward_in_order(manager: RewardLoopManager) -> None:
    samples = numbered(50)  # not a multiple of the workers: verl pads the last chunk, and drops the padding
    assert batch_path(manager, samples) == float32(expected(samples))


def faulty(samples: list[dict[str, Any]], *bad: int) -> list[dict[str, Any]]:
    """``samples`` with those at ``bad`` in the ``faulty`` environment, whose plugin raises for them."""
    return [
        {**sample, "data_source": "faulty", "extra_info": {"mode": "raise"}} if n in bad else sample
        for n, sample in enumerate(samples)
    ]


def assert_own_failure(error: BaseException) -> None:
    """verl re-raises the worker's error as Ray does (a ``RayTaskError`` that is also the engine's class):
    the ``VerificationError`` naming the failing call's own sample (its only one: index 0)."""
    assert isinstance(error, engine.VerificationError), repr(error)
    assert (error.environment, type(error.environment), error.index, error.kind) == ("faulty", str, 0, "plugin")
    assert "the plugin blew up" in error.reason


def test_a_failing_sample_fails_verls_step_on_either_path_with_the_error_naming_it(
    manager: RewardLoopManager,
) -> None:
    """verl gathers its samples' calls (``asyncio.gather`` in ``AgentLoopWorker.generate_sequences``,
    ``ray.get`` in ``compute_rm_score``): the first error ends the step; no reward is made up for it."""
    samples = faulty(numbered(16), 5)
    errors = [raised(lambda: streamed(manager, samples)), raised(lambda: batch_path(manager, samples))]
    for error in errors:
        assert_own_failure(error)
        assert "'faults:by_task'" in str(error) and "environment 'faulty'" in str(error), str(error)  # the traceback's
    # in process, the engine's own ERROR line too, where docs/trainers/verl.md says to look: the reward
    # workers' logs (Ray's worker-*.err); with url= the step's traceback is what the page points to
    if "config" in manager.config.reward.custom_reward_function.reward_kwargs:
        line = "batch aborted: plugin verifier 'faults:by_task' (environment 'faulty') failed on item"
        logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"  # no public API names it
        wait_until(lambda: line in "".join(path.read_text(errors="replace") for path in logs.glob("worker-*.err")),
                   60, "the engine's ERROR line is in no reward worker's log")


def test_one_failing_sample_fails_only_its_own_call_of_those_a_reward_worker_gathered(
    manager: RewardLoopManager,
) -> None:
    """verl's per-sample Ray call (``RewardLoopWorker.compute_score``, one sample each: what the streaming
    path sends, what ``compute_score_batch`` runs per sample) sent for every sample at once to one reward
    worker, each call settled on its own: the calls the adapter gathered with the failing one get their
    own rewards (finding 6), round after round until a round shows the failing call was gathered (its
    error carries the note saying so)."""
    handle = manager.reward_loop_workers[0]
    gathered = 0
    for round_ in range(8):
        bad = (7 * round_ + 3) % 64
        samples = faulty(numbered(64), bad)
        output = generated(manager, samples)
        calls = [handle.compute_score.remote(output[i : i + 1]) for i in range(len(output))]
        outcomes = [raised(lambda call=call: ray.get(call)) if n == bad else ray.get(call)
                    for n, call in enumerate(calls)]
        for n, outcome in enumerate(outcomes):
            if n == bad:
                assert_own_failure(outcome)
            else:
                reward = expected(samples)[n]
                assert outcome == {"reward_score": reward, "reward_extra_info": {"acc": reward}}, (n, bad)
        gathered += bool(getattr(outcomes[bad], "__notes__", None))
        if gathered:
            break
    assert gathered, "the reward worker never gathered the failing call with another: nothing was shown"


def test_an_unknown_data_source_is_named_as_a_plain_string(manager: RewardLoopManager) -> None:
    """verl's streaming path hands ``np.str_`` data sources: the error names the environment as the user
    wrote it (``'probe'``, not ``np.str_('probe')``), and it is the engine's misuse error, not a reward."""
    error = raised(lambda: streamed(manager, numbered(4, environment="probe")))
    assert isinstance(error, ValueError), repr(error)
    assert "'probe'" in str(error) and "np.str_" not in str(error), str(error)
