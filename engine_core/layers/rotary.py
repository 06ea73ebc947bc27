"""Rotary position embedding tables (default, linear, llama3, YaRN, LongRoPE and proportional scaling), computed as HF
computes them, over all of a head's dimensions or its first `rotary_dim` (partial rotary: Phi-4-mini's 3/4).

LongRoPE (Phi-3, Phi-4-mini) divides each frequency by a factor from one of two lists: `short_factor` for
contexts within `original_max_position_embeddings`, `long_factor` beyond. Hugging Face picks the list per
forward call, by the call's largest position: a prompt longer than the original context runs with the long
factors throughout, a shorter one with the short factors, until generation passes the original length; from
then on new tokens get the long factors while the cached keys keep the short ones. A serving engine cannot
do that: its KV blocks are shared between requests (prefix caching), prompts run in chunks and preempted
requests are recomputed, so a token's keys must depend on its position alone. Here, as in vLLM, the list is
chosen once for the engine, by the context it serves (`context_len`, its max_model_len): the long factors
when that exceeds the original context, else the short ones. Tokens then equal Hugging Face's for every
request that stays within the original context when the engine serves no more (`--max-model-len` at most
`original_max_position_embeddings`), and for every prompt longer than the original context otherwise; a
shorter prompt served by an engine of a longer context runs with the long factors where Hugging Face uses
the short ones.
"""

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


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss; HF's `_compute_yarn_parameters`): each frequency blends its interpolated (divided by
    `factor`) and original value by a linear ramp between the dimensions that turn `beta_fast` and
    `beta_slow` times over the original context (`truncate`, HF's default True: the ramp's ends rounded to
    whole dimensions). Also returns the attention factor the cos/sin tables are scaled by."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # (HF's guard against a zero-width ramp)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp  # (the share of each frequency kept as it was)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope_inv_freq(
    rotary_dim: int, theta: float, scaling: dict, max_position: int, context_len: int
) -> tuple[torch.Tensor, float]:
    """LongRoPE (HF's `_compute_longrope_parameters`): each frequency divided by its entry of `long_factor`
    when the engine's context exceeds `original_max_position_embeddings`, else of `short_factor` (see the
    module's docstring). The attention factor scales cos and sin: the config's, else sqrt(1 + log(factor) /
    log(original)) with factor = max_position_embeddings / original (1 if that is not above 1)."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = scaling["long_factor"] if context_len > original else scaling["short_factor"]
    if len(factors) != rotary_dim // 2:
        raise ValueError(f"longrope: {len(factors)} factors for {rotary_dim // 2} rotary frequencies")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    return inv_freq, float(attention_factor)


def _proportional_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Proportional RoPE (Gemma 4's full layers; HF's `_compute_proportional_rope_parameters`): the first
    `partial_rotary_factor` of the head's frequencies as the default rope over the whole head computes them,
    the rest zero, so those dimension pairs (i, i + head_dim / 2) are not rotated; all divided by `factor`.
    Unlike partial rotary (`rotary_dim`), the rotated pairs stay half a head apart."""
    rotated = int(float(scaling.get("partial_rotary_factor", 1.0)) * inv_freq.shape[0])
    inv_freq = inv_freq.clone()
    inv_freq[rotated:] = 0.0
    return inv_freq / float(scaling.get("factor", 1.0))


class RotaryEmbedding(nn.Module):
    cos_sin_cache: torch.Tensor  # [max_position, rot]: cos, then sin (a buffer: nn.Module types it loosely)

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict | None = None,
        is_neox_style: bool = True,
        rotary_dim: int | None = None,
        context_len: int | None = None,
    ):
        """`rotary_dim`: the dimensions rotated, the first of each head (all by default); `context_len`: the
        positions the engine serves (its max_model_len; `max_position` by default), which picks LongRoPE's
        factors."""
        super().__init__()
        rotary_dim = rotary_dim or head_dim
        inv_freq = _inv_freq(rotary_dim, theta)
        scaling = scaling or {}
        rope_type = scaling.get("rope_type", "default")
        positions = torch.arange(max_position, dtype=torch.int64).float()
        attention_factor = 1.0  # (YaRN's and LongRoPE's: cos and sin scaled by it)
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(rotary_dim, theta, scaling, max_position)
        elif rope_type == "longrope":
            context = context_len or max_position
            inv_freq, attention_factor = _longrope_inv_freq(rotary_dim, theta, scaling, max_position, context)
        elif rope_type == "proportional":
            inv_freq = _proportional_inv_freq(inv_freq, scaling)
        elif rope_type != "default":
            raise NotImplementedError(f"rope scaling type {rope_type!r} is not supported")
        freqs = positions[:, None] * inv_freq[None, :]
        table = torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)
        self.register_buffer("cos_sin_cache", table, persistent=False)
        self.is_neox_style = is_neox_style

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        return ops.rotary_embedding(positions, query, key, self.cos_sin_cache, self.is_neox_style)
