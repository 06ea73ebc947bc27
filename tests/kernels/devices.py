"""Where the Triton kernel tests run: compiled on a GPU when there is one (benchmarks/gpu_check.sh),
else on the CPU through Triton's interpreter, which tests/conftest.py switches on before anything
imports Triton. Test modules use `pytestmark = pytest.mark.usefixtures("on_device")` (the fixture is in
tests/kernels/conftest.py) and draw their random inputs from `make_generator`."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)
