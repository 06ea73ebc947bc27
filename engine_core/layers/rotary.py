"""Rotary position embedding tables (default, linear and llama3 scaling), computed as HF computes them."""

from __future__ import annotations

import math

import torch
from torch import nn

from pagoda.kernels import ops


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    cos_sin_cache: torch.Tensor  # [max_position, rot]: cos, then sin (a buffer: nn.Module types it loosely)

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None, is_neox_style: bool = True
    ):
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta)
        scaling = scaling or {}
        rope_type = scaling.get("rope_type", "default")
        positions = torch.arange(max_position, dtype=torch.int64).float()
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type != "default":
            raise NotImplementedError(f"rope scaling type {rope_type!r} is not supported")
        freqs = positions[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)
        self.is_neox_style = is_neox_style

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        return ops.rotary_embedding(positions, query, key, self.cos_sin_cache, self.is_neox_style)
