#!/usr/bin/env bash
# What requirements-openrlhf.txt cannot say; run by `make trainers` from the project root, $1 the venv's python.
# DeepSpeed's sdist imports torch to build (so no build isolation: the venv's CPU torch); OpenRLHF without its
# dependencies (flash-attn, bitsandbytes, vLLM: GPU builds its reward path never calls, see standins/openrlhf).
set -euo pipefail
"$1" -m pip install --quiet --no-build-isolation deepspeed==0.19.6
"$1" -m pip install --quiet --no-deps openrlhf==0.11.2
