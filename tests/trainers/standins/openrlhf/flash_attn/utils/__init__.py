"""Stand-in (see flash_attn's docstring)."""
