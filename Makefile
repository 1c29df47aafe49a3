# Every target creates .venv and installs what it needs; nothing else is required.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install -q --disable-pip-version-check

.PHONY: install test demo examples digits nnx ensemble char_lm parallel multihost lora bench fuzz fuzz-linen fuzz-nnx dump docs lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-%: pyproject.toml | $(BIN)/python
	$(PIP) -e '.[$*]'
	touch $@

install: $(VENV)/.installed-test

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n 2 tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

fuzz: $(VENV)/.installed-test
	VARJAX_FUZZ_EXAMPLES=10000 $(BIN)/python -m pytest -s -p no:xdist tests/test_fuzz.py

# Differential test against Flax Linen: every failing example is recorded and the run goes on;
# the XLA flags cut the CPU compile time, most of each example's, by about a third.
# `VARJAX_LINEN_EXAMPLES=500 make fuzz-linen` runs one chunk of a longer run.
fuzz-linen: $(VENV)/.installed-test
	VARJAX_LINEN_EXAMPLES=$${VARJAX_LINEN_EXAMPLES:-3000} VARJAX_LINEN_KEEP_GOING=1 \
	XLA_FLAGS="--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true" \
	$(BIN)/python -m pytest -s -p no:xdist tests/test_linen_diff.py

# Differential test against flax.nnx in its three modes, as fuzz-linen: every failing example
# is recorded and the run goes on; `VARJAX_NNX_EXAMPLES=200 make fuzz-nnx` runs one chunk of a
# longer run, `VARJAX_NNX_MODES=tree make fuzz-nnx` one mode (graph, no_updates, tree).
fuzz-nnx: $(VENV)/.installed-test
	VARJAX_NNX_EXAMPLES=$${VARJAX_NNX_EXAMPLES:-1000} VARJAX_NNX_KEEP_GOING=1 \
	XLA_FLAGS="--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true" \
	$(BIN)/python -m pytest -s -p no:xdist tests/test_nnx_diff.py

demo: $(VENV)/.installed-examples
	$(BIN)/python examples/demo.py

digits ensemble char_lm parallel multihost lora: %: $(VENV)/.installed-examples
	$(BIN)/python examples/$(subst lora,lora_finetune,$*).py

# The digits CNN in NNX style on varjax.nnx, then on flax.nnx (the bench extra brings Flax).
nnx: $(VENV)/.installed-examples $(VENV)/.installed-bench
	$(BIN)/python examples/nnx_digits.py

examples: digits ensemble char_lm

bench: $(VENV)/.installed-bench
	$(BIN)/python -m bench --results

dump: $(VENV)/.installed-examples
	rm -rf dumps && VARJAX_DUMP_DIR=dumps $(BIN)/python examples/demo.py > /dev/null
	find dumps -type f | sort

# The API reference, generated from the docstrings (tests/test_api_docs.py builds it in CI).
docs: $(VENV)/.installed-docs
	$(BIN)/python -m docs.build docs/api
	@echo "API reference: docs/api/index.html"

lint: $(VENV)/.installed-test
	$(BIN)/python -m ruff check varjax passes tests bench examples
	@test "$$(git grep -l 'jax\._src' -- varjax passes)" = "varjax/_jax.py" || \
	  (echo "jax._src imported outside varjax/_jax.py:"; git grep -l 'jax\._src' -- varjax passes; exit 1)

clean:
	rm -rf $(VENV) dumps docs/api .pytest_cache .hypothesis
