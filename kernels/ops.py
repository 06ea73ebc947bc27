"""Kernel dispatch (`pagoda.kernels.ops`): model code calls these functions; each picks its implementation
by device.

Every op has a plain torch implementation (`pagoda.kernels.torch_ref`), the reference in tests and the
fallback everywhere. On the CPU, ops with a compiled C kernel (`pagoda.kernels.cpu`) use it when it builds.
On CUDA every op but the CPU-only ones (`_CPU_ONLY`: the float32 panel linear, whose weights only
the CPU path packs, and the greedy argmax, which torch's CUDA reduction does well) has a Triton kernel
with the same signature (`pagoda.kernels.triton`), imported the first time a CUDA tensor asks for one, so
CPU processes never load Triton; FP8 linears use torch's own CUDA kernel instead
(`torch._scaled_mm`, kernels/fp8.py). `configure` turns the compiled
C kernels or Triton off (the torch path is then used: the reference the GPU check compares against)
and says where C kernels are built; the engine calls it from its environment (engine_core/
environment.py), since this package reads no environment of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from pagoda.kernels import fp8 as _fp8
from pagoda.kernels import mxfp4 as _mxfp4
from pagoda.kernels import panels as _panels
from pagoda.kernels import quantized as _quantized
from pagoda.kernels.fp8 import Fp8Weight as Fp8Weight  # (re-exported, like PackedWeight)
from pagoda.kernels.panels import PanelWeight as PanelWeight
from pagoda.kernels.quantized import PackedWeight as PackedWeight  # (re-exported: the model layers hold one)
from pagoda.kernels.torch_ref import attention as _attn
from pagoda.kernels.torch_ref import gated_delta as _gated_delta
from pagoda.kernels.torch_ref import layers as _layers
from pagoda.kernels.torch_ref import moe as _moe
from pagoda.kernels.torch_ref import sampling as _sampling

_TORCH: dict[str, Callable] = {
    "reshape_and_cache": _attn.reshape_and_cache,
    "paged_decode_attention": _attn.paged_decode_attention,
    "paged_prefill_attention": _attn.paged_prefill_attention,
    "varlen_attention": _attn.varlen_attention,
    "rms_norm": _layers.rms_norm,
    "fused_add_rms_norm": _layers.fused_add_rms_norm,
    "silu_and_mul": _layers.silu_and_mul,
    "rotary_embedding": _layers.rotary_embedding,
    "quantized_linear": _quantized.reference_linear,
    "fp8_linear": _fp8.reference_linear,
    "panel_linear": _panels.reference_linear,
    "argmax_rows": _sampling.argmax_rows,
    "fused_moe": _moe.fused_moe,
    "mxfp4_dequantize": _mxfp4.dequantize,
    "causal_conv1d": _gated_delta.causal_conv1d,
    "gated_delta_rule": _gated_delta.gated_delta_rule,
    "gdn_gating": _gated_delta.gdn_gating,
    "rms_norm_gated": _gated_delta.rms_norm_gated,
}
_CUDA_NATIVE: dict[str, Callable] = {"fp8_linear": _fp8.scaled_mm_linear}  # torch's cuBLASLt FP8 GEMM
_CPU_COMPILED = {
    "paged_decode_attention",
    "paged_prefill_attention",
    "varlen_attention",
    "rotary_embedding",
    "reshape_and_cache",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "quantized_linear",
    "panel_linear",
    "argmax_rows",
    "fused_moe",  # (experts packed at load, ExpertPanels or PackedExperts, or Mxfp4Experts; plain ones: the reference)
    "mxfp4_dequantize",
    "causal_conv1d",
    "gated_delta_rule",
    "gdn_gating",
    "rms_norm_gated",
}
# Ops with no Triton kernel, for which a CUDA tensor gets the reference: the panel linear (a CUDA linear
# keeps its plain weight for cuBLAS and never holds panels), the greedy argmax (torch's own CUDA
# reduction does it well), and MXFP4's dequantization (torch's lookup and ldexp on the GPU).
_CPU_ONLY = {"panel_linear", "argmax_rows", "mxfp4_dequantize"}
# Ops whose torch reference reads values on the host (the fused MoE loops over the experts the tokens
# chose; Gated DeltaNet's conv1d and delta rule loop over the sequences), which a CUDA graph cannot capture;
# their kernels read nothing there.
_HOST_READS = {"fused_moe", "causal_conv1d", "gated_delta_rule"}
_enabled = {"cpu": True, "cuda": True}  # compiled C kernels on the CPU, Triton on CUDA


def configure(
    cpu_kernels: bool = True,
    triton: bool = True,
    build_dir: Path | None = None,
    int8_activations: bool = False,
    amx: bool = True,
) -> None:
    """Which implementations to use from now on, and where C kernels are built (default: a
    directory per user under the system's temporary directory). `int8_activations`: quantized linears
    on the CPU round their input rows to int8 below prefill sizes, where the CPU has VNNI (faster; the
    engine turns it on unless told not to, EngineConfig.int8_activations). `amx`: the panel linear's
    bulk rows run on Intel's AMX where the CPU has it (kernels/cpu/amx_matmul.c)."""
    from pagoda.kernels import cpu

    _enabled["cpu"], _enabled["cuda"] = cpu_kernels, triton
    cpu.settings.int8_activations = int8_activations
    cpu.settings.amx = amx
    if build_dir is not None:
        cpu.settings.build_dir = Path(build_dir)
    _resolve.cache_clear()


def _triton(name: str) -> Callable:
    from pagoda.kernels.triton import attention, gated_delta, layers, moe, quantized, varlen_attention

    for module in (attention, varlen_attention, layers, quantized, moe, gated_delta):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"no Triton kernel named {name}")


@functools.cache
def _resolve(name: str, device_type: str) -> Callable:
    if device_type == "cuda" and _enabled["cuda"] and name not in _CPU_ONLY:
        return _CUDA_NATIVE[name] if name in _CUDA_NATIVE else _triton(name)
    if device_type == "cpu" and name in _CPU_COMPILED and _enabled["cpu"]:
        from pagoda.kernels import cpu

        if cpu.available():
            return getattr(cpu, name)
    return _TORCH[name]


def op_names() -> list[str]:
    """Every op this module dispatches, in the table's order (`pagoda env` lists each one's pick)."""
    return list(_TORCH)


def implementation(name: str, device: torch.device) -> Callable:
    """The function that runs `name` for tensors on `device` (resolved once per device type)."""
    return _resolve(name, device.type)


def compiled(name: str, device: torch.device) -> bool:
    """Whether `name` runs a compiled or Triton kernel on `device` rather than the torch reference."""
    return _resolve(name, device.type) is not _TORCH[name]


def graph_safe(name: str, device: torch.device) -> bool:
    """Whether `name` on `device` reads nothing on the host, so that a CUDA graph can capture it: every
    kernel, and every torch reference but those of `_HOST_READS`."""
    return name not in _HOST_READS or compiled(name, device)


def bulk_rows_differ(device: torch.device) -> bool:
    """Whether `panel_linear`'s bulk rows run on another unit than its other rows on `device` (Intel's AMX,
    kernels/cpu/amx_matmul.c); where they do not, a caller need not tell them apart."""
    if device.type != "cpu" or not compiled("panel_linear", device):
        return False
    from pagoda.kernels import cpu

    return cpu.amx_used()


def _dispatching(name: str) -> Callable:
    def call(first: torch.Tensor, *args, **kwargs):
        return implementation(name, first.device)(first, *args, **kwargs)

    call.__name__ = name
    call.__doc__ = _TORCH[name].__doc__
    return call


reshape_and_cache = _dispatching("reshape_and_cache")
# The attention ops take keyword options that every implementation honours: `sinks` (gpt-oss's attention
# sinks, [H]) and `softcap` (Gemma 2's attention logit soft-capping, 0 = off): kernels/torch_ref/attention.py.
paged_decode_attention = _dispatching("paged_decode_attention")
paged_prefill_attention = _dispatching("paged_prefill_attention")
varlen_attention = _dispatching("varlen_attention")  # whole sequences, no cache: pooling models
rms_norm = _dispatching("rms_norm")
fused_add_rms_norm = _dispatching("fused_add_rms_norm")
silu_and_mul = _dispatching("silu_and_mul")
rotary_embedding = _dispatching("rotary_embedding")
quantized_linear = _dispatching("quantized_linear")  # (x, PackedWeight, bias=None): see kernels/quantized.py
fp8_linear = _dispatching("fp8_linear")  # (x, Fp8Weight, bias=None): see kernels/fp8.py
# (x, PanelWeight, bias=None, bulk_rows_from=None): float32 on the CPU, kernels/panels.py
panel_linear = _dispatching("panel_linear")
argmax_rows = _dispatching("argmax_rows")  # (logits [B, V]) -> [B] int64: greedy sampling's pick
# (hidden [T, H], router_logits [T, E], w13 [E, 2I, H], w2 [E, H, I], Routing) -> [T, H], the
# experts plain, packed (ExpertPanels, PackedExperts) or MXFP4: kernels/torch_ref/moe.py, on the CPU
# kernels/cpu/moe.c, on CUDA kernels/triton/moe.py
fused_moe = _dispatching("fused_moe")
# (blocks uint8 [..., G, 16], scales uint8 [..., G], dtype) -> [..., G * 32]: MXFP4 experts, kernels/mxfp4.py
mxfp4_dequantize = _dispatching("mxfp4_dequantize")
# Gated DeltaNet (Qwen3.5/3.6's linear-attention layers), kernels/torch_ref/gated_delta.py for the contracts:
# varlen batches (cu_seqlens [B + 1]) whose per-sequence conv and recurrent states live in pools, read and
# updated in place at state_slots [B]. On the CPU kernels/cpu/gated_delta.c, on CUDA kernels/triton/gated_delta.py.
# (x [T, C], weight [C, K], bias, conv_states [slots, K - 1, C], cu_seqlens, state_slots, activation) -> [T, C]
causal_conv1d = _dispatching("causal_conv1d")
# (q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], states [slots, Hv, Dk, Dv] float32, cu_seqlens,
# state_slots, use_qk_l2norm=True) -> [T, Hv, Dv]
gated_delta_rule = _dispatching("gated_delta_rule")
gdn_gating = _dispatching("gdn_gating")  # (a, b [T, Hv], A_log, dt_bias [Hv]) -> (g float32, beta)
# (x, gate [R, Dv] or [T, Hv, Dv], weight [Dv], eps) -> x's shape
rms_norm_gated = _dispatching("rms_norm_gated")


def embedding_rows(
    weight: PackedWeight | Fp8Weight | PanelWeight, ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `ids` of a packed weight, in `dtype`: the embedding lookup of a tied LM head stored packed."""
    if isinstance(weight, PanelWeight):
        return weight.rows(ids).to(dtype)
    if isinstance(weight, Fp8Weight):
        return weight.rows(ids, dtype)
    return _quantized.embedding_rows(weight, ids, dtype)
