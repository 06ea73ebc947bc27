"""Inputs for the paged-attention tests: random K/V scattered into random, non-contiguous cache blocks
(never-written slots hold NaN), the shapes they cover, and naive attention over contiguous K/V to
check against."""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.kernels import ops


def naive_attention(q, k, v, q_start_pos, scale, sliding_window=None):
    """q [Q, H, D] at positions q_start_pos.., k/v [L, Hkv, D] -> [Q, H, D], in float64."""
    groups = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(groups, dim=1)
    v = v.double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    qpos = torch.arange(q.shape[0])[:, None] + q_start_pos
    kpos = torch.arange(k.shape[0])[None, :]
    allowed = kpos <= qpos
    if sliding_window is not None:
        allowed &= kpos > qpos - sliding_window
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def scatter_to_cache(seq_lens, block_size, num_kv_heads, head_dim, gen):
    total_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    # Never-written slots hold NaN: a kernel that lets them into its result fails the NaN checks.
    key_cache = torch.full((total_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    free = (torch.randperm(total_blocks - 1, generator=gen) + 1).tolist()  # block 0 is the null block
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.long)
    keys, values = [], []
    for b, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        block_tables[b, :nb] = torch.tensor([free.pop() for _ in range(nb)])
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        pos = torch.arange(n)
        slots = block_tables[b, pos // block_size] * block_size + pos % block_size
        ops.reshape_and_cache(k, v, key_cache, value_cache, slots)
        keys.append(k)
        values.append(v)
    return key_cache, value_cache, block_tables, keys, values


SHAPES = [(64, 16, 1), (64, 32, 4), (128, 16, 8), (128, 32, 2)]


def run_attention(monkeypatch, libraries, which, function_name, *args, **kwargs):
    """Attention op `function_name` by the torch reference (`which` None), the native C build ("native"),
    or one ISA variant's build (a key of `libraries`, the paged_libraries fixture's); skipped where the C
    kernels are not built."""
    from pagoda.kernels.cpu import attention as cpu_attention
    from pagoda.kernels.torch_ref import attention as ref

    if which is None:
        return getattr(ref, function_name)(*args, **kwargs)
    if which != "native":
        monkeypatch.setattr(cpu_attention, "load", lambda: libraries[which])
    if cpu_attention.load() is None:
        pytest.skip("the CPU kernels are not built here")
    return getattr(cpu_attention, function_name)(*args, **kwargs)
