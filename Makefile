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

.PHONY: install model serve generate test test-fast bench clean

install: $(STAMP) model

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[test]" "$(TORCH)"
	touch $(STAMP)

model: $(STAMP)
	$(VENV)/bin/pagoda download-default

# The OpenAI-compatible server on the default model: http://127.0.0.1:8000 (SERVE_ARGS adds flags).
serve: install
	$(VENV)/bin/pagoda serve $(SERVE_ARGS)

test: install
	$(PY) -m pytest -q tests

test-fast: install
	$(PY) -m pytest -q -m "not slow" tests

bench: install
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
