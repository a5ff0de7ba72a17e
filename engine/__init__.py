"""engine: an async batch scoring engine for reinforcement-learning training of language models.

A batch of rollouts goes in; one float reward per item comes out, in input order, or one
``VerificationError`` naming the verifier that failed. Never a zero in place of a failure.

This module is the package's one public face: every name in ``__all__`` and nothing else (the
modules behind it are private, ``engine._*``, and a test holds this list to what they export).
The names are imported on first use (PEP 562), so that ``import engine`` is cheap and changes
nothing in its host process: the ``engine`` command imports this package before it can handle a
Ctrl-C (``engine.__main__``).
"""

from __future__ import annotations

from importlib import import_module as _import_module  # not `import importlib`: engine.importlib would be a module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine._backfill.writer import RewardRecord, read_rewards
    from engine._blocking import BlockingEngine
    from engine._config import EngineConfig, JudgeConfig, Limits, load_config
    from engine._core.contract import AsyncVerifyFn, VerifyFn
    from engine._core.report import BatchResult, VerifierReport
    from engine._engine import Engine
    from engine._environments.digest import digest_directory
    from engine._environments.manifest import KINDS, Environment, VerifierSpec, load_environment
    from engine._errors import (
        ConfigError,
        DigestError,
        EngineError,
        InputError,
        ManifestError,
        OutputError,
        ResumeError,
        RubricError,
        ServiceError,
        VerificationError,
        WriteError,
    )
    from engine._verifiers.rubric.prompt import flatten

__all__ = [
    "KINDS",
    "AsyncVerifyFn",
    "BatchResult",
    "BlockingEngine",
    "ConfigError",
    "DigestError",
    "Engine",
    "EngineConfig",
    "EngineError",
    "Environment",
    "InputError",
    "JudgeConfig",
    "Limits",
    "ManifestError",
    "OutputError",
    "ResumeError",
    "RewardRecord",
    "RubricError",
    "ServiceError",
    "VerificationError",
    "VerifierReport",
    "VerifierSpec",
    "VerifyFn",
    "WriteError",
    "digest_directory",
    "flatten",
    "load_config",
    "load_environment",
    "read_rewards",
]

_MODULES = {  # where each public name lives
    "BlockingEngine": "engine._blocking",
    "EngineConfig": "engine._config",
    "JudgeConfig": "engine._config",
    "Limits": "engine._config",
    "load_config": "engine._config",
    "digest_directory": "engine._environments.digest",
    "Engine": "engine._engine",
    "ConfigError": "engine._errors",
    "DigestError": "engine._errors",
    "EngineError": "engine._errors",
    "InputError": "engine._errors",
    "ManifestError": "engine._errors",
    "OutputError": "engine._errors",
    "ResumeError": "engine._errors",
    "RubricError": "engine._errors",
    "ServiceError": "engine._errors",
    "VerificationError": "engine._errors",
    "WriteError": "engine._errors",
    "Environment": "engine._environments.manifest",
    "KINDS": "engine._environments.manifest",
    "VerifierSpec": "engine._environments.manifest",
    "load_environment": "engine._environments.manifest",
    "BatchResult": "engine._core.report",
    "VerifierReport": "engine._core.report",
    "flatten": "engine._verifiers.rubric.prompt",
    "AsyncVerifyFn": "engine._core.contract",
    "VerifyFn": "engine._core.contract",
    "RewardRecord": "engine._backfill.writer",
    "read_rewards": "engine._backfill.writer",
}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # the public names and the module's own dunders: not this module's imports (Any, TYPE_CHECKING ...)
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})
