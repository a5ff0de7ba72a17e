"""Import-only stand-in for sglang-router (SGLang's request router): see tests/trainers/standins/slime/README.md."""
