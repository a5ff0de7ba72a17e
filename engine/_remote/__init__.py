"""The client side of ``engine serve``: what ``Engine.connect`` returns (``client``) and the JSON both sides speak
(``wire``). It sits below ``engine._engine``, which imports it lazily; the service itself (``engine._serve``)
sits above it, and nothing here imports the server's dependencies."""
