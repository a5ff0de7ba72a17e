"""engine: an async batch scoring engine for reinforcement-learning training of language models.

A batch of rollouts goes in; one float reward per item comes out, in input order, or one
``VerificationError`` naming the verifier that failed. Never a zero in place of a failure.
"""

from .blocking import BlockingEngine
from .config import EngineConfig, Limits, load_config
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
