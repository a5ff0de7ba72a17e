# Two commands on a fresh machine with Python 3.11 and make:
#   make run    score the shipped example rollouts (starts the example verifier service itself)
#   make test   lint, type-check and run the whole test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,ray]'  # ray: the suite runs the --ray backfill on a local Ray
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python examples/run.py

test: $(STAMP)
	$(BIN)/ruff check engine tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/pytest -q

# Not part of the two commands: the throughput benchmarks (minutes; see benchmarks/README.md).
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	$(BIN)/python benchmarks/bench_plugin.py
	$(BIN)/python benchmarks/bench_endpoint.py
	$(BIN)/python benchmarks/bench_abort.py
	$(BIN)/python benchmarks/bench_backfill.py
	$(BIN)/python benchmarks/bench_loop.py
	$(BIN)/python benchmarks/bench_cores.py
	$(BIN)/python benchmarks/bench_serve.py
	$(BIN)/python benchmarks/soak_serve.py
	$(BIN)/python benchmarks/bench_adapters.py
	$(BIN)/python benchmarks/bench_ray.py

clean:
	rm -rf $(VENV) out .pytest_cache .mypy_cache .ruff_cache
