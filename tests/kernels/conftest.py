"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.devices import DEVICE


@pytest.fixture
def on_device():
    """Tensors the test creates land on DEVICE (the Triton tests' GPU, or the CPU interpreter)."""
    with torch.device(DEVICE):
        yield
