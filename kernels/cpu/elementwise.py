"""Rotary embedding and the KV-cache write on the CPU (kernels/cpu/elementwise.c): bit for bit the torch
references' results (built without fast-math)."""

from __future__ import annotations

import torch

from pagoda.kernels.cpu.arguments import as_int64, rows_contiguous
from pagoda.kernels.cpu.loader import load


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `pagoda.kernels.torch_ref.layers.rotary_embedding`; rotates `query` and `key` in place."""
    lib = load()
    if (
        lib is None
        or not (rows_contiguous(query) and rows_contiguous(key))
        or cos_sin_cache.dtype != torch.float32
        or not cos_sin_cache.is_contiguous()
    ):
        from pagoda.kernels.torch_ref.layers import rotary_embedding as reference

        return reference(positions, query, key, cos_sin_cache, is_neox_style)
    positions = as_int64(positions)
    lib["rotary_embedding_f32"](
        positions.data_ptr(),
        query.data_ptr(),
        key.data_ptr(),
        cos_sin_cache.data_ptr(),
        query.shape[0],
        query.shape[1],
        key.shape[1],
        query.shape[2],
        cos_sin_cache.shape[1],
        query.stride(0),
        key.stride(0),
        int(is_neox_style),
    )
    return query, key


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as `pagoda.kernels.torch_ref.attention.reshape_and_cache` (float32 rows, CPU; a float32 or
    float16 cache)."""
    lib = load()
    function = None
    if lib is not None and key.dtype == value.dtype == torch.float32 and key_cache.dtype == value_cache.dtype:
        if key_cache.dtype == torch.float32:
            function = lib["reshape_and_cache_f32"]
        elif key_cache.dtype == torch.float16:
            function = lib.get("reshape_and_cache_f16kv")  # (compilers without _Float16 have none)
    if (
        function is None
        or not (rows_contiguous(key) and rows_contiguous(value))
        or not (key_cache.is_contiguous() and value_cache.is_contiguous())
    ):
        from pagoda.kernels.torch_ref.attention import reshape_and_cache as reference

        return reference(key, value, key_cache, value_cache, slot_mapping)
    slot_mapping = as_int64(slot_mapping)
    function(
        key.data_ptr(),
        value.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        slot_mapping.data_ptr(),
        key.shape[0],
        key.shape[1] * key.shape[2],
        key.stride(0),
        value.stride(0),
    )
