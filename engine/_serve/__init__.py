"""``engine serve``: one engine for a whole training job, over HTTP.

``limits``, ``metrics``, ``openrlhf``, ``app`` and ``server`` are the service's; they sit above
``engine._engine``, beside the CLI. The client that talks to it, and the JSON both sides speak, are
``engine._remote``'s, below the engine (``Engine.connect`` returns its client).
"""
