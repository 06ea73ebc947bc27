"""Shared fixtures: the real default model (prepared once, as `make install` does) and HF references."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from pagoda.engine_core.environment import cache_root, configure_kernels

# Without a GPU, Triton kernels run on the CPU through Triton's interpreter. `@triton.jit` picks the
# interpreter when it decorates, so this must be set before any test module imports a kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Engines in tests keep float activations (as --no-int8-activations): most tests compare a quantized
# engine's greedy tokens with Hugging Face's on the dequantized weights, which only float activations
# match. The int8 path is tested where a test asks for it (the `int8_activations_on` fixture below, and
# tests/kernels/test_quantized_linear.py against the rounded rows).
os.environ.setdefault("PAGODA_DISABLE_INT8_ACTIVATIONS", "1")

# Kernels the tests call directly build where the engine's do (PAGODA_CACHE), not in a temporary directory.
configure_kernels()


@pytest.fixture
def int8_activations_on(monkeypatch):
    """Engines made in this test (and servers it starts) round quantized linears' inputs to int8 where the
    CPU has VNNI, as a user's do by default."""
    monkeypatch.delenv("PAGODA_DISABLE_INT8_ACTIVATIONS", raising=False)
    yield
    from pagoda.kernels import cpu

    cpu.settings.int8_activations = False  # (an engine made in the test set it for the whole process)


@pytest.fixture(scope="session")
def default_model_dir():
    from pagoda.engine_core.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def hf_model(default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from pagoda.engine_core.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture
def cli_main():
    """`pagoda.api_proc.cli.main`, run in this process. It points the root logger at the stderr pytest captures for
    the test, which is closed after it: its handler goes afterwards, or a thread still logging (a KV pool's
    populate, engine_core/kv_prefault.py) would print a logging error into a later test's output."""
    from pagoda.api_proc.cli import main

    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield main
    for handler in root.handlers[:]:
        if handler not in before and type(handler) is logging.StreamHandler:
            root.removeHandler(handler)
    root.setLevel(level)


def pytest_unconfigure(config):
    """The free disk where the suite writes, as the output's last line (also after an internal error): a disk
    that fills up fails every later test that writes a file, then pytest itself, with errors that do not
    say why."""
    free = [f"{_free_gib(where):.1f} GiB free under {where}" for where in (Path(tempfile.gettempdir()), cache_root())]
    sys.stderr.write("disk: " + ", ".join(free) + "\n")


def _free_gib(path: Path) -> float:
    while not path.is_dir():  # (the cache may not exist yet: its nearest existing folder's disk)
        path = path.parent
    return shutil.disk_usage(path).free / 2**30
