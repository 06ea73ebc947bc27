"""FP8 (E4M3) weights: `quant_method: fp8` checkpoints, and `--quantization fp8` at load.

Per-tensor and per-channel FP8 weights become `pagoda.kernels.fp8.Fp8Weight`s (one scale per output channel). Where
FP8 matmuls run (CUDA of compute capability 8.9 or newer, bfloat16: kernels/fp8.py `supported`), the
loader keeps them in FP8 and every linear multiplies on FP8 tensor cores through `torch._scaled_mm`, with
activations quantized per token: half the weight memory of bfloat16. Elsewhere (the CPU, older GPUs) the
loader dequantizes them once to the compute dtype, with a log line saying so: `_scaled_mm` runs on the CPU
(torch 2.13) but 40-50x slower than float32 `F.linear` on SmolLM2's shapes. Block-wise FP8 (128x128 blocks,
DeepSeek-V3 / Qwen3-FP8) is dequantized at load on every device: its scales do not fit one per channel, and
the block-scaled `_scaled_mm` could not be run where this was written.

`quant_method: fp8` checkpoints come in two layouts, both read here:
- block-wise (DeepSeek-V3, Qwen3-FP8, what transformers' FineGrainedFP8 writes): `weight_block_size:
  [bn, bk]`, and `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] multiplying each block (the name is
  historical: it is the dequantization factor), float32 or UE8M0 (`scale_fmt: ue8m0`, powers of two);
- per tensor (AutoFP8 and vLLM's serialized FP8): no block size, one `weight_scale` per tensor (or per
  output channel).
`input_scale` / `activation_scale` (static activation scales) are not used: activations stay in float.
"""

from __future__ import annotations

import logging

import torch

from pagoda.engine_core.quantization.base import QuantizationMethod
from pagoda.kernels.fp8 import Fp8Weight, quantize_per_channel

logger = logging.getLogger(__name__)

FP8_PATH = "FP8 matmuls on CUDA (compute capability >= 8.9, bfloat16), dequantized at load elsewhere"
BLOCKS_DEQUANTIZED = "dequantized at load to the compute dtype on every device: no memory saving"


def dequantize_fp8(
    name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None
) -> torch.Tensor:
    """The float32 weight [N, K] of an E4M3 `weight` and its `scale`: one value (per tensor), N values
    (per output channel), or with `block` (bn, bk) one value per block, [ceil(N/bn), ceil(K/bk)]."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: FP8 weight has dtype {weight.dtype}; only float8_e4m3fn (E4M3) is supported")
    if weight.dim() != 2:
        raise ValueError(f"{name}: FP8 weight has shape {tuple(weight.shape)}, expected 2 dimensions")
    n, k = weight.shape
    s = scale.float()
    if block is not None:
        bn, bk = block
        grid = (-(-n // bn), -(-k // bk))
        if tuple(s.shape) != grid:
            raise ValueError(f"{name}: block scales have shape {tuple(s.shape)}, expected {grid} for blocks {block}")
        s = s.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    elif s.numel() == 1:
        s = s.reshape(1, 1)
    elif s.numel() == n:
        s = s.reshape(n, 1)
    else:
        raise ValueError(
            f"{name}: FP8 scale has shape {tuple(scale.shape)}; expected one value per tensor or per output "
            f"channel ({n}), or weight_block_size in the config"
        )
    return weight.float() * s


def fp8_weight(
    name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None
) -> Fp8Weight | torch.Tensor:
    """A checkpoint's FP8 linear: an `Fp8Weight` when its scales are per tensor or per output channel
    (the loader keeps it in FP8 where FP8 matmuls run), else (blocks) the float32 weight."""
    if block is not None or weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        return dequantize_fp8(name, weight, scale, block)  # (which also names what is wrong)
    n = weight.shape[0]
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        s = s.expand(n)
    elif s.numel() != n:
        return dequantize_fp8(name, weight, scale, block)  # raises: the scale's shape is wrong
    return Fp8Weight(weight.contiguous(), s.contiguous())


class Fp8Checkpoint(QuantizationMethod):
    """A `quant_method: fp8` checkpoint; every FP8 linear is dequantized to the compute dtype at load."""

    name = "fp8"
    kinds = frozenset({"weight", "weight_scale", "weight_scale_inv", "input_scale", "activation_scale"})

    def __init__(self, block: tuple[int, int] | None, scale_fmt: str, activation_scheme: str):
        self.block = block
        self.scale_fmt = scale_fmt
        self.activation_scheme = activation_scheme
        self.scale_kind = "weight_scale_inv" if block is not None else "weight_scale"
        self.required = frozenset({"weight", self.scale_kind})

    @classmethod
    def from_config(cls, qcfg: dict) -> Fp8Checkpoint:
        fmt = str(qcfg.get("fmt") or "e4m3").lower()
        if fmt != "e4m3":
            raise ValueError(f"fp8 checkpoint with fmt {fmt!r}: only e4m3 (float8_e4m3fn weights) is supported")
        scale_fmt = str(qcfg.get("scale_fmt") or "float").lower()
        if scale_fmt not in ("float", "ue8m0"):
            raise ValueError(f"fp8 checkpoint with scale_fmt {scale_fmt!r}: supported are float and ue8m0")
        block_size = qcfg.get("weight_block_size")
        block = None
        if block_size is not None:
            if len(block_size) != 2 or not all(isinstance(b, int) and b > 0 for b in block_size):
                raise ValueError(f"fp8 checkpoint: weight_block_size {block_size!r} is not two positive integers")
            block = (block_size[0], block_size[1])
        activation_scheme = str(qcfg.get("activation_scheme") or "dynamic").lower()
        if activation_scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 checkpoint: activation_scheme {activation_scheme!r}; supported: dynamic, static")
        return cls(block, scale_fmt, activation_scheme)

    def layout(self) -> str:
        if self.block is None:
            return f"E4M3 weights, scales per tensor or channel; {FP8_PATH}"
        return f"E4M3 weights, scales in blocks of {self.block[0]}x{self.block[1]}; {BLOCKS_DEQUANTIZED}"

    def from_checkpoint(
        self, name: str, tensors: dict[str, torch.Tensor], out_features: int, in_features: int
    ) -> Fp8Weight | torch.Tensor:
        return fp8_weight(name, tensors["weight"], tensors[self.scale_kind], self.block)

    def describe(self) -> str:
        return f"fp8 ({self.layout()})"


class Fp8AtLoad(QuantizationMethod):
    """`--quantization fp8`: every linear but the LM head rounded to E4M3 with one scale per output
    channel, as llmcompressor's FP8 recipes do (the LM head stays in full precision there too). Where FP8
    matmuls run they are kept in FP8; elsewhere held dequantized, which still serves the weights an FP8
    checkpoint of this model would hold (its accuracy), and the log says that it saves no memory there."""

    name = "fp8"
    quantizes_full_precision = True

    def quantize(self, name: str, weight: torch.Tensor) -> Fp8Weight | torch.Tensor:
        if name == "lm_head":
            return weight
        return quantize_per_channel(weight)

    def describe(self) -> str:
        return f"fp8 (E4M3 per channel, quantized at load, LM head in full precision; {FP8_PATH})"
