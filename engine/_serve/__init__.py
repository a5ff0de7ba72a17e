"""``engine serve``: one engine for a whole training job, over HTTP, and the client that talks to it.

``wire`` is the format both sides share; ``client`` is what ``Engine.connect`` returns (it imports
nothing above ``engine._core``); ``limits``, ``metrics``, ``openrlhf``, ``app`` and ``server`` are
the service's (they sit above ``engine._engine``, beside the CLI). Nothing is imported here: the
client must not pull in the server's dependencies.
"""
