"""Element-wise and normalization ops in plain torch, written to match Hugging Face's float math."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    orig_dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(orig_dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream update and the next norm in one op."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`x` `[..., 2I]` holding gate and up halves -> silu(gate) * up `[..., I]`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox_style: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `query` `[T, H, D]` and `key` `[T, Hkv, D]` by their positions.

    `cos_sin_cache` `[max_pos, rot_dim]` holds cos in the first half and sin in the second. Neox style
    rotates the two halves of the rotary dims (HF's rotate_half); GPT-J style rotates even/odd pairs.
    Returns new tensors (the Triton kernel works in place; callers use the return value either way).
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, rot/2]
    return _rotate(query, cos, sin, is_neox_style), _rotate(key, cos, sin, is_neox_style)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool) -> torch.Tensor:
    rot_dim = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    if is_neox_style:
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, x_pass), dim=-1) if x_pass.numel() else rotated
