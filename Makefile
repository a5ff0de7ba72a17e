# Two commands on a fresh machine with Python 3.11 and make:
#   make run    score the shipped example rollouts (starts the example verifier service itself)
#   make test   lint, type-check and run the whole test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run

# The trainers suite (tests/trainers/README.md): each trainer's released code in a venv of its own, their pins
# conflicting; slime is not on the registry, so its source (the shared folder beside the clone) goes on PYTHONPATH.
TRAINERS ?= trl verl openrlhf slime verifiers
SLIME_SOURCE := $(abspath $(CURDIR)/../shared/thirdparty/slime-624b824)
STANDINS := $(CURDIR)/tests/trainers/standins
# the engine and the suite's tools in each trainer's venv; verl's hydra pins antlr4 4.9, which the dev extra's
# math-verify[antlr4_13_2] refuses, so verl's venv takes only what its suite runs on
ENGINE_FOR = -e '.[dev]'
ENGINE_FOR_verl = -e . pytest pytest-timeout

.PHONY: run test docs trainers bench clean

# what the suite needs: ray (it runs the --ray backfill on a local Ray) and docs (it builds the site --strict)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,ray,docs]'
	touch $(STAMP) $(RUN_STAMP)

# what make run needs: the engine and the examples' math-verify, not the suite's tools or Ray
$(RUN_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[examples]'
	touch $(RUN_STAMP)

run: $(RUN_STAMP)
	$(BIN)/python examples/run.py

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

test: $(STAMP)
	$(BIN)/ruff check engine tests benchmarks examples scripts
	$(BIN)/mypy
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site
	$(MAKE) trainers
	$(BIN)/pytest -q

.venv-%/.installed: tests/trainers/requirements-%.txt tests/trainers/constraints-%.txt pyproject.toml
	test -x .venv-$*/bin/python || $(PYTHON) -m venv .venv-$*
	.venv-$*/bin/python -m pip install --quiet --upgrade pip
	.venv-$*/bin/python -m pip install --quiet -r tests/trainers/requirements-$*.txt \
		-c tests/trainers/constraints-$*.txt $(or $(ENGINE_FOR_$*),$(ENGINE_FOR))
	if [ -f tests/trainers/install-$*.sh ]; then bash tests/trainers/install-$*.sh .venv-$*/bin/python; fi
	touch $@

trainers: $(foreach trainer,$(TRAINERS),.venv-$(trainer)/.installed)
	for trainer in $(TRAINERS); do \
		path=$(STANDINS)/$$trainer; if [ $$trainer = slime ]; then path=$$path:$(SLIME_SOURCE); fi; \
		ENGINE_TRAINER=$$trainer PYTHONPATH=$$path .venv-$$trainer/bin/pytest -q -p no:cacheprovider \
			tests/trainers/test_$$trainer.py || exit 1; \
	done

# Not part of the two commands: the throughput benchmarks (minutes; see benchmarks/README.md).
bench: $(STAMP) .venv-verl/.installed
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
	.venv-verl/bin/python benchmarks/bench_adapters.py --verl  # verl's own reward loop, in its venv
	$(BIN)/python benchmarks/bench_ray.py

clean:
	rm -rf $(VENV) .venv-* out site .pytest_cache .mypy_cache .ruff_cache
