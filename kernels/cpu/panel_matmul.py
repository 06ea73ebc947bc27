"""Float32 linears on the CPU with weights in panels (kernels/cpu/panel_matmul.c), their bulk rows on Intel's
AMX where the CPU has it and `settings.amx` allows it (kernels/cpu/amx_matmul.c)."""

from __future__ import annotations

import torch

from pagoda.kernels import panels
from pagoda.kernels.cpu.arguments import THREADED_WORK
from pagoda.kernels.cpu.loader import load, settings


def panel_linear(
    x: torch.Tensor, weight: panels.PanelWeight, bias: torch.Tensor | None = None, bulk_rows_from: int | None = None
) -> torch.Tensor:
    """Same contract as `pagoda.kernels.panels.reference_linear` (float32 on the CPU: kernels/cpu/panel_matmul.c;
    with `bulk_rows_from`, those rows on Intel's AMX where the CPU has it: kernels/cpu/amx_matmul.c)."""
    lib = load()
    if lib is None or x.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        return panels.reference_linear(x, weight, bias)
    return _panel_linear(lib, x, weight, bias, bulk_rows_from)


# Bulk rows may use AMX (`settings.amx`, which pagoda.kernels.ops.configure sets). A model's projections, one
# call per weight, SmolLM2's 30 layers on two threads (benchmarks/kernel_ops.py --only dense,
# docs/decode-speed.md): panel matmul against AMX, 1 row 14.2 / 26.5 ms (AMX splits every weight into bf16
# pieces on each call), 64 rows 39.1 / 36.4, 128 rows 72.4 / 56.9, 512 rows 276 / 190. The engine sends it long
# prompts' rows only.
_amx_works: bool | None = None  # (the kernel's answer to one small call, once per process)


def amx_used() -> bool:
    """Whether the panel linear's bulk rows run on AMX in this process: the switch is on, the kernels
    built, and the AMX kernel computes (the CPU has AMX and Linux lets the process use it)."""
    global _amx_works
    lib = load()
    if not settings.amx or lib is None:
        return False
    if _amx_works is None:
        weight = panels.PanelWeight.pack(torch.ones(32, 32))
        x, out = torch.ones(1, 32), torch.empty(1, 32)
        _amx_works = bool(
            lib["amx_linear_f32"](x.data_ptr(), weight.data.data_ptr(), None, out.data_ptr(), 1, 32, 32, 1)
        )
    return _amx_works


def _panel_linear(
    lib, x: torch.Tensor, weight: panels.PanelWeight, bias: torch.Tensor | None, bulk_rows_from: int | None = None
) -> torch.Tensor:
    k, n = weight.in_features, weight.out_features
    if x.shape[-1] != k:  # (the C kernel would read past the rows)
        raise ValueError(f"panel_linear: input has {x.shape[-1]} features, the weight takes {k}")
    rows = x if x.dim() == 2 else x.reshape(-1, k)  # (the model's calls are 2-D: no reshape op)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    m = rows.shape[0]
    out = torch.empty((m, n) if x.dim() == 2 else (*x.shape[:-1], n), dtype=torch.float32)
    bias_pointer = None if bias is None else bias.data_ptr()
    split = m if bulk_rows_from is None or not settings.amx else max(0, min(bulk_rows_from, m))
    if split < m:  # (the bulk rows, contiguous at the end)
        threads = torch.get_num_threads()
        offset_in, offset_out = split * k * 4, split * n * 4
        done = lib["amx_linear_f32"](
            rows.data_ptr() + offset_in,
            weight.data.data_ptr(),
            bias_pointer,
            out.data_ptr() + offset_out,
            m - split,
            k,
            n,
            threads,
        )
        if not done:  # (the kernel refused: no AMX after all, or no memory)
            split = m
    if split:
        threads = torch.get_num_threads() if split * k * n >= THREADED_WORK else 1
        lib["panel_linear_f32"](
            rows.data_ptr(), weight.data.data_ptr(), bias_pointer, out.data_ptr(), split, k, n, threads
        )
    return out
