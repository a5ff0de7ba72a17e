"""engine: an async batch scoring engine for reinforcement-learning training of language models.

A batch of rollouts goes in; one float reward per item comes out, in input order, or one
``VerificationError`` naming the verifier that failed. The package's one public face: the names of
its stub, ``__init__.pyi``, imported on first use (docs/design.md, "The public face").
"""

from __future__ import annotations

import os as _os
from importlib import import_module as _import_module  # not `import importlib`: engine.importlib would be a module

_homes: dict[str, str] | None = None  # each public name -> the private module it lives in, read on first use


def _public() -> dict[str, str]:
    """Each public name and its module, as the stub imports them (``from engine._x import Name as Name``)."""
    global _homes
    if _homes is None:
        import ast

        with open(_os.path.join(_os.path.dirname(__file__), "__init__.pyi"), encoding="utf-8") as stub:
            tree = ast.parse(stub.read())
        _homes = {
            alias.asname or alias.name: str(node.module)
            for node in tree.body
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }
    return _homes


def __getattr__(name: str) -> object:
    homes = _public()
    if name == "__all__":
        value: object = sorted(homes)
    elif name in homes:
        value = getattr(_import_module(homes[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # the public names and the module's own dunders: not this module's imports (os, import_module ...)
    return sorted({*_public(), "__all__", *(name for name in globals() if name.startswith("__"))})
