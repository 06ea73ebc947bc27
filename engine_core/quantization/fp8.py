"""FP8 (E4M3) weights: `quant_method: fp8` checkpoints, and `--quantization fp8` at load.

Pagoda has no FP8 matmul: every device dequantizes FP8 weights once, at load, to the compute dtype,
so an FP8 model takes the memory of a full-precision one and computes like it; only the FP8 rounding of
the weights remains. Why not `torch._scaled_mm`: on the CPU it runs (torch 2.13) but 40-50x slower than
`F.linear` in float32 on SmolLM2's shapes, and the CUDA path it is meant for (FP8 tensor cores, with
activations quantized per token) could not be run and tested where this was written. It is the next step
for CUDA (docs/quantization.md).

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

from engine_core.quantization.base import QuantizationMethod

logger = logging.getLogger(__name__)

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
NO_FP8_MATMUL = "dequantized at load to the compute dtype: no FP8 matmul yet, so no memory saving"


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


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 weight [N, K] and float32 scales [N, 1] with each row's absmax at 448 (round to nearest)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (w / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


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
        method = cls(block, scale_fmt, activation_scheme)
        logger.info("FP8 checkpoint (%s): %s", method.layout(), NO_FP8_MATMUL)
        return method

    def layout(self) -> str:
        weights = "per tensor" if self.block is None else f"blocks of {self.block[0]}x{self.block[1]}"
        return f"E4M3 weights, scales {weights}; {self.activation_scheme} FP8 activations served in float"

    def from_checkpoint(
        self, name: str, tensors: dict[str, torch.Tensor], out_features: int, in_features: int
    ) -> torch.Tensor:
        return dequantize_fp8(name, tensors["weight"], tensors[self.scale_kind], self.block)

    def describe(self) -> str:
        return f"fp8 ({self.layout()}; {NO_FP8_MATMUL})"


class Fp8AtLoad(QuantizationMethod):
    """`--quantization fp8`: every linear but the LM head rounded to E4M3 with one scale per output
    channel, as llmcompressor's FP8 recipes do (the LM head stays in full precision there too), then
    held dequantized. Chosen over refusing the flag: it serves the weights an FP8 checkpoint of this
    model would hold (its accuracy), on any device; the log says that it saves no memory."""

    name = "fp8"
    quantizes_full_precision = True

    def __init__(self):
        logger.warning("--quantization fp8: weights rounded to FP8 E4M3 per channel and %s", NO_FP8_MATMUL)

    def quantize(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        if name == "lm_head":
            return weight
        fp8, scale = quantize_fp8_per_channel(weight)
        return fp8.float() * scale

    def describe(self) -> str:
        return f"fp8 (E4M3 per channel, quantized at load, LM head in full precision; {NO_FP8_MATMUL})"
