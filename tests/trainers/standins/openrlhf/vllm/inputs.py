"""Stand-in (see vllm's docstring): TokensPrompt, which vLLM defines as a TypedDict: a plain dict here."""

TokensPrompt = dict
