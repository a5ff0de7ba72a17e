"""Stand-in for vLLM (CUDA builds only, pinning a CUDA torch): OpenRLHF imports it at module level in its
rollout actor (openrlhf.trainer.ray.vllm_engine) and sample generator. The tests replace vLLM's engine
(what RolloutRayActor.__init__ builds) by a stand-in generator of their own (tests/trainers/openrlhf_support.py),
so the reward path runs unmodified around it. What OpenRLHF reaches here: ``__version__`` (checked only
when an engine is built), ``SamplingParams`` (built by SamplesGenerator, read by the executor: a plain
holder of its keyword arguments), and the engine classes, which raise if used."""

from typing import Any, NoReturn

__version__ = "0.29.0"  # the release OpenRLHF 0.11.2's `vllm` extra pins


class SamplingParams:
    """What vLLM's SamplingParams holds, as attributes (the executor reads max_tokens and logprobs)."""

    def __init__(self, **kwargs: Any) -> None:
        self.max_tokens = None
        self.logprobs = None
        self.__dict__.update(kwargs)


class _GpuOnly:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _gpu_only()

    @classmethod
    def from_engine_args(cls, *args: Any, **kwargs: Any) -> NoReturn:
        _gpu_only()


def _gpu_only() -> NoReturn:
    raise RuntimeError("vllm is a test stand-in here: the tests generate with a stand-in engine")


AsyncEngineArgs = AsyncLLMEngine = LLM = _GpuOnly
