"""NaN-poisoned allocation for the kernel tests: inside `poisoned_empty()`, `torch.empty` returns float tensors
filled with NaN, so an output element a kernel fails to write shows up as NaN (and NaN never passes)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def poisoned_empty():
    """torch.empty returns NaN-filled float tensors inside the block: unwritten outputs become NaN."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real_empty
