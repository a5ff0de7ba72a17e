"""``engine serve``: one engine for a whole training job, over HTTP (docs/design.md, The service)."""
