"""Shared fixtures: the real default model (prepared once, as `make install` does) and HF references."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model_dir():
    from engine_core.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def hf_model(default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from detok_proc.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)
