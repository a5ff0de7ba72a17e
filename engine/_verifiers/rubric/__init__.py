"""The rubric kind: an LLM judge grades against a versioned written rubric."""
