"""Import-only stand-in for SGLang (slime's GPU inference server): see tests/trainers/standins/slime/README.md."""
