"""engine: an async batch scoring engine for reinforcement-learning training of language models.

A batch of rollouts goes in; one float reward per item comes out, in input order, or one
``VerificationError`` naming the verifier that failed. Never a zero in place of a failure.

The names below are imported on first use (PEP 562), so that ``import engine`` is cheap: the
``engine`` command imports this package before it can handle a Ctrl-C (``engine.__main__``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .blocking import BlockingEngine
    from .config import EngineConfig, JudgeConfig, Limits, load_config
    from .digest import digest_directory
    from .engine import Engine
    from .errors import ConfigError, DigestError, EngineError, ManifestError, VerificationError
    from .manifest import KINDS, Environment, VerifierSpec, load_environment
    from .report import BatchResult, VerifierReport
    from .trajectory import flatten
    from .verifier import AsyncVerifyFn, Verifier, VerifyFn

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
    "JudgeConfig",
    "Limits",
    "ManifestError",
    "VerificationError",
    "Verifier",
    "VerifierReport",
    "VerifierSpec",
    "VerifyFn",
    "digest_directory",
    "flatten",
    "load_config",
    "load_environment",
]

_MODULES = {  # where each public name lives
    "BlockingEngine": "blocking",
    "EngineConfig": "config",
    "JudgeConfig": "config",
    "Limits": "config",
    "load_config": "config",
    "digest_directory": "digest",
    "Engine": "engine",
    "ConfigError": "errors",
    "DigestError": "errors",
    "EngineError": "errors",
    "ManifestError": "errors",
    "VerificationError": "errors",
    "KINDS": "manifest",
    "Environment": "manifest",
    "VerifierSpec": "manifest",
    "load_environment": "manifest",
    "BatchResult": "report",
    "VerifierReport": "report",
    "flatten": "trajectory",
    "AsyncVerifyFn": "verifier",
    "Verifier": "verifier",
    "VerifyFn": "verifier",
}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
