# Pagoda: `make serve` starts the server on the default model, `make test` runs the suite.
# Both set everything up on a fresh machine (a .venv beside this file, the default model in the cache).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.pagoda-installed
# torch is pinned for the CPU set-up: this version's CPU wheel is what these machines carry;
# an unpinned torch would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0

.PHONY: install model serve generate test test-fast lint bench clean quant-tools tool-venvs

install: $(STAMP) model

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[test,lint]" "$(TORCH)"
	touch $(STAMP)

# The quantization tool the compressed-tensors tests make their checkpoints with (llmcompressor, and HF
# transformers with compressed-tensors as their reference): its own venv, as it pins transformers and
# others differently from .venv (tests/quant_tools/llmcompressor.txt).
LLMC_VENV  := .venv-llmcompressor
LLMC_STAMP := $(LLMC_VENV)/.pagoda-installed
LLMC_REQS  := tests/quant_tools/llmcompressor.txt

quant-tools: $(LLMC_STAMP) .venv-gptq/$(TOOL_STAMP) .venv-awq/$(TOOL_STAMP)

$(LLMC_STAMP): $(LLMC_REQS)
	$(PYTHON) -m venv $(LLMC_VENV)
	$(LLMC_VENV)/bin/python -m pip install -q --upgrade pip
	$(LLMC_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(LLMC_VENV)/bin/python -m pip install -q -r $(LLMC_REQS) "$(TORCH)"
	touch $(LLMC_STAMP)

# Venvs of the quantization tools the GPTQ / AWQ tests run (tests/gptq_awq_checkpoints.py): GPTQModel and
# AutoAWQ pull other versions of transformers than ours, so each has its own, from a pinned
# requirements file; the stamp is written only once the install is complete.
TOOL_STAMP := .pagoda-tool-installed

tool-venvs: quant-tools

.venv-gptq/$(TOOL_STAMP): tests/quant_tools/gptq.txt
	rm -rf .venv-gptq
	$(PYTHON) -m venv .venv-gptq
	.venv-gptq/bin/python -m pip install -q "$(TORCH)"
	.venv-gptq/bin/python -m pip install -q -r tests/quant_tools/gptq.txt
	touch $@

.venv-awq/$(TOOL_STAMP): tests/quant_tools/awq.txt
	rm -rf .venv-awq
	$(PYTHON) -m venv .venv-awq
	.venv-awq/bin/python -m pip install -q "$(TORCH)"
	.venv-awq/bin/python -m pip install -q -r tests/quant_tools/awq.txt
	touch $@

model: $(STAMP)
	$(VENV)/bin/pagoda download-default

# The OpenAI-compatible server on the default model: http://127.0.0.1:8000 (SERVE_ARGS adds flags).
serve: install
	$(VENV)/bin/pagoda serve $(SERVE_ARGS)

# Tests run in a random order (pytest-randomly): PYTEST_FLAGS="-p no:randomly" for file order,
# "--randomly-seed=N" to repeat one (.ci/run pins one).
test: install quant-tools
	$(PY) -m pytest -q $(PYTEST_FLAGS) tests

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_FLAGS) tests

# Style and structure: ruff (lint + format), the import layers (import-linter, pyproject.toml), types
# of engine_core (mypy), and no test module importing another.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy engine_core
	@! grep -rEn "^\s*(from|import) tests\.([a-z_]+\.)*test_" tests || (echo "tests must not import test modules"; false)

bench: install
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) $(LLMC_VENV) .venv-gptq .venv-awq .pytest_cache .hypothesis
