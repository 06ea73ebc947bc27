"""The fused MoE's Triton kernels (kernels/triton/moe.py) compiled to cubins for sm_90 (H100/H200) without a
GPU: `python -m tests.kernels.moe_sm90` prints, as JSON, each kernel's shared memory, registers per thread
and spill stack in every configuration the dispatch picks. Run without TRITON_INTERPRET, which replaces
the kernels with the interpreter's (test_triton_moe.py runs it in a child process)."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagoda.kernels.triton import moe as tri

# Qwen3-30B-A3B's routing (128 experts, top-8), which picks the block sizes; its hidden size (2048) and
# expert width (768) are multiples of 16, which is all the compile sees of them.
_EXPERTS, _TOP_K = 128, 8
SHARED_MEMORY_LIMIT = 228 * 1024  # an H100/H200 SM's shared memory (up to 227 KiB for one block)


def compile_for_sm90() -> list[dict]:
    """Each MoE kernel compiled to a cubin for sm_90 in every configuration the dispatch picks (fp32, fp16,
    bf16; the decode and batch block sizes at Qwen3-30B-A3B's shapes): rows of kernel, dtype, pairs,
    blocks, warps, shared memory (bytes), registers per thread and spill stack (bytes)."""
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

    def build(kernel, pointers: dict, ints: list, constants: dict, num_warps: int, num_stages: int) -> dict:
        signature = {**pointers, **dict.fromkeys(ints, "i32"), **dict.fromkeys(constants, "constexpr")}
        index = {name: i for i, name in enumerate(kernel.arg_names)}
        # What the launcher specializes at these shapes: pointers and the sizes and strides that are
        # multiples of 16 (every one here but the per-call pair count) divisible by 16.
        aligned = [n for n in signature if signature[n] != "constexpr" and n != "num_pairs"]
        source = ASTSource(
            kernel,
            signature,
            {(index[n],): value for n, value in constants.items()},
            attrs={(index[n],): [["tt.divisibility", 16]] for n in aligned},
        )
        compiled = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages)
        )
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True).stdout
        registers, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
        return dict(shared=compiled.metadata.shared, registers=int(registers), spill_stack=int(stack))

    experts, top_k = _EXPERTS, _TOP_K
    gemm_ints = ["num_pairs", "num_experts", "hidden_size", "inter_size"]
    rows = []
    for dtype, name in names.items():
        pointer = f"*{name}"
        for tokens in (1, 256):
            pairs = tokens * top_k
            block_m, block_n, block_k, num_warps = tri._block_sizes(pairs, experts, dtype)
            blocks = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=False)
            blocks["DOT_PRECISION"] = tri._dot_precision(dtype)
            common = dict(sorted_pairs_ptr="*i32", block_expert_ptr="*i32")
            gate_up, geglu = (
                build(
                    tri._gate_up_kernel,
                    dict(hidden_ptr=pointer, w13_ptr=pointer, out_ptr=pointer, **common),
                    [*gemm_ints, "stride_hm", "stride_we", "stride_wn", "stride_om"],
                    dict(TOP_K=top_k, GELU=gelu, **blocks),
                    num_warps,
                    tri._NUM_STAGES,
                )
                for gelu in (False, True)  # (SiLU; Gemma 4's GeGLU)
            )
            down = build(
                tri._down_kernel,
                dict(act_ptr=pointer, w2_ptr=pointer, weights_ptr="*fp32", out_ptr=pointer, **common),
                [*gemm_ints, "stride_am", "stride_we", "stride_wn", "stride_om"],
                dict(WEIGHTS_IN_DTYPE=True, **blocks),
                num_warps,
                tri._NUM_STAGES,
            )
            shape = dict(dtype=name, pairs=pairs, blocks=[block_m, block_n, block_k], warps=num_warps)
            rows += [dict(kernel="gate_up", **shape, **gate_up), dict(kernel="gate_up_geglu", **shape, **geglu)]
            rows.append(dict(kernel="down", **shape, **down))
        summed = build(
            tri._sum_kernel,
            dict(pair_out_ptr=pointer, local_ids_ptr="*i32", out_ptr=pointer),
            ["num_experts", "hidden_size", "stride_pm", "stride_om"],
            dict(TOP_K=top_k, BLOCK=tri._SUM_BLOCK),
            4,
            tri._NUM_STAGES,
        )
        rows.append(dict(kernel="sum", dtype=name, pairs=None, blocks=[tri._SUM_BLOCK], warps=4, **summed))
    return rows


if __name__ == "__main__":
    print(json.dumps(compile_for_sm90()))
