"""Kernel dispatch: model code calls these functions; each picks its implementation by device.

Every op has a plain torch implementation (`kernels.torch_ref`), the reference in tests and the
fallback everywhere. On the CPU, ops with a compiled C kernel (`kernels.cpu`) use it when it builds.
On CUDA every op has a Triton kernel with the same signature (`kernels.triton`), imported the first
time a CUDA tensor asks for one, so CPU processes never load Triton. `PAGODA_DISABLE_CPU_KERNELS=1`
forces the torch path on the CPU, `PAGODA_DISABLE_TRITON=1` on CUDA (the reference the GPU check
compares against).
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import torch

from kernels.torch_ref import attention as _attn
from kernels.torch_ref import layers as _layers

_TORCH: dict[str, Callable] = {
    "reshape_and_cache": _attn.reshape_and_cache,
    "paged_decode_attention": _attn.paged_decode_attention,
    "paged_prefill_attention": _attn.paged_prefill_attention,
    "rms_norm": _layers.rms_norm,
    "fused_add_rms_norm": _layers.fused_add_rms_norm,
    "silu_and_mul": _layers.silu_and_mul,
    "rotary_embedding": _layers.rotary_embedding,
}
_CPU_COMPILED = {"paged_decode_attention", "rotary_embedding", "reshape_and_cache"}
# Read once, at import.
_CPU_KERNELS_DISABLED = os.environ.get("PAGODA_DISABLE_CPU_KERNELS") == "1"
_TRITON_DISABLED = os.environ.get("PAGODA_DISABLE_TRITON") == "1"


def _triton(name: str) -> Callable:
    from kernels.triton import attention, layers

    return getattr(attention, name, None) or getattr(layers, name)


@functools.lru_cache(maxsize=None)
def _resolve(name: str, device_type: str) -> Callable:
    if device_type == "cuda" and not _TRITON_DISABLED:
        return _triton(name)
    if device_type == "cpu" and name in _CPU_COMPILED and not _CPU_KERNELS_DISABLED:
        from kernels import cpu

        if cpu.available():
            return getattr(cpu, name)
    return _TORCH[name]


def implementation(name: str, device: torch.device) -> Callable:
    """The function that runs `name` for tensors on `device` (resolved once per device type)."""
    return _resolve(name, device.type)


def _dispatching(name: str) -> Callable:
    def call(first: torch.Tensor, *args, **kwargs):
        return implementation(name, first.device)(first, *args, **kwargs)

    call.__name__ = name
    call.__doc__ = _TORCH[name].__doc__
    return call


reshape_and_cache = _dispatching("reshape_and_cache")
paged_decode_attention = _dispatching("paged_decode_attention")
paged_prefill_attention = _dispatching("paged_prefill_attention")
rms_norm = _dispatching("rms_norm")
fused_add_rms_norm = _dispatching("fused_add_rms_norm")
silu_and_mul = _dispatching("silu_and_mul")
rotary_embedding = _dispatching("rotary_embedding")
