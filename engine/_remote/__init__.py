"""The client side of ``engine serve``: what ``Engine.connect`` returns, and the JSON both sides speak.

Below ``engine._engine``, above nothing of the server's: docs/design.md, Remote engine.
"""
