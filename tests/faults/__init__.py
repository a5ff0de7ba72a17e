"""The fault-injection suite: every way a verifier can fail, driven through the public API."""
