"""The weights of a GGUF file as (checkpoint name, tensor) pairs, read from the file at every load.

The file is memory-mapped; each tensor is read when its turn comes. Float tensors (F32, F16, BF16)
arrive as `<module>.weight` / `.bias` in their own dtype. A quantized linear weight arrives as two
tensors of the GGUF quantization method (engine_core/quantization/gguf.py), kept raw for it to repack:
`<module>.gguf_blocks` (uint8 [rows, bytes per row], the file's blocks) and `<module>.gguf_type`
(0-dim, the GGML type number). Any other quantized tensor (an untied embedding table, a norm; every one
of a gpt-oss file's but its MXFP4 experts) is dequantized to float32 here.

gpt-oss's MXFP4 experts (GGML type MXFP4) arrive in Hugging Face's MXFP4 layout (kernels/mxfp4.py), repacked
losslessly from ggml's blocks (`mxfp4_from_ggml`): `<module>.blocks` (uint8 [experts, rows, columns / 32,
16]) and `<module>.scales` (uint8 [experts, rows, columns / 32]).

llama.cpp stores Llama's q/k projection rows in its own rotary order; they are put back in Hugging
Face's order here. Rows move whole, with the scales of their blocks (blocks run along a row), so the
same permutation serves raw blocks and float rows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from pagoda.engine_core import gguf_qwen35
from pagoda.engine_core.gguf_model import FLOAT_TYPES, GGUFTensor

logger = logging.getLogger(__name__)

MXFP4_BLOCK = 17  # bytes of one ggml MXFP4 block of 32 values: its exponent, then 16 bytes of nibbles


def unpermute_rope(rows, num_heads: int):
    """Undo llama.cpp's q/k row permutation (it interleaves the rotary halves of each head; Hugging
    Face keeps them split). Works on any array whose first axis is the rows."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def iterate_gguf_weights(
    path: Path, tensors: list[GGUFTensor], dequantize: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every tensor of the file, in its order. `dequantize`: every tensor
    as float32 (the float32 model directory of the default model)."""
    if not dequantize:
        _log_conversions(tensors)
    # Copy-on-write: torch wants writable arrays, and nothing is ever written back to the file.
    data = np.memmap(path, dtype=np.uint8, mode="c")
    for t in tensors:
        raw = data[t.offset : t.offset + t.nbytes]
        if t.experts:  # (stacked experts: each expert's rows are a contiguous run of the tensor's bytes)
            rows = raw.reshape(t.experts, -1)
            shape = t.shape[1:]
            for expert in range(t.experts):
                name = t.hf_name.format(expert=expert)
                yield from _tensor_weights(rows[expert], GGUFTensor(**{**asdict(t), "shape": shape}), name, dequantize)
        else:
            yield from _tensor_weights(raw, t, t.hf_name, dequantize)


def _tensor_weights(
    raw: np.ndarray, t: GGUFTensor, hf_name: str, dequantize: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of one GGUF tensor `t` (or one expert's part of it) whose bytes are `raw`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    module = hf_name.rpartition(".")[0]
    ggml_type = GGMLQuantizationType[t.type]
    if t.type == "MXFP4" and not dequantize:
        mxfp4_blocks, scales = mxfp4_from_ggml(torch.from_numpy(raw).view(*t.shape[:-1], -1, MXFP4_BLOCK))
        yield f"{module}.blocks", mxfp4_blocks
        yield f"{module}.scales", scales
    elif t.type in FLOAT_TYPES or not t.linear or dequantize:
        array = _float_array(raw, t, ggml_type, gguf_dequantize)
        type_name = t.type
        if t.rope_heads:
            array = unpermute_rope(array, t.rope_heads)
        if t.layout:  # (Qwen3.5's linear attention: engine_core/gguf_qwen35.py)
            if type_name == "BF16":  # (its bits as float32, exactly: ssm_a's log needs values)
                array, type_name = (array.astype(np.int32) << 16).view(np.float32), "F32"
            array = gguf_qwen35.to_hf(array, t.layout)
        yield hf_name, _to_torch(array, type_name)
    else:
        blocks = raw.reshape(t.shape[0], -1)
        if t.rope_heads:
            blocks = unpermute_rope(blocks, t.rope_heads)
        if t.layout:
            blocks = gguf_qwen35.blocks_to_hf(blocks, t.layout, t.type)
        yield f"{module}.gguf_type", torch.tensor(int(ggml_type))
        yield f"{module}.gguf_blocks", torch.from_numpy(np.ascontiguousarray(blocks))


def mxfp4_from_ggml(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's MXFP4 blocks (uint8 [..., 17]) -> Hugging Face's (blocks uint8 [..., 16], scales uint8 [...]).

    A ggml block is its e8m0 exponent byte, then 16 bytes whose low nibbles hold values 0-15 and high
    nibbles values 16-31; Hugging Face keeps the exponent apart as the scale and packs values 2j and 2j+1
    into byte j's low and high nibble. Both read a value as its E2M1 code times 2^(exponent - 127) (the
    gguf package's tables hold half that scale and doubled values: the same product), so the exponent byte
    is the scale as it is and the codes only change places: lossless."""
    codes = torch.cat((blocks[..., 1:] & 0x0F, blocks[..., 1:] >> 4), dim=-1)  # [..., 32]: values in order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), blocks[..., 0].contiguous()


def _log_conversions(tensors: list[GGUFTensor]) -> None:
    """Say, once per load, what happens to the file's tensors that do not load as stored (the GGUF
    quantization method logs the linears it repacks)."""
    dequantized: dict[str, list[str]] = {}
    mxfp4 = [t.name for t in tensors if t.type == "MXFP4"]
    for t in tensors:
        if t.type not in FLOAT_TYPES and t.type != "MXFP4" and not t.linear:
            dequantized.setdefault(t.type, []).append(t.name)
    if mxfp4:
        logger.info(
            "GGUF MXFP4 weights (%d tensors, e.g. %s): kept 4-bit, repacked losslessly into the MXFP4 experts' layout",
            len(mxfp4),
            mxfp4[0],
        )
    for type_name, names in dequantized.items():
        logger.info(
            "GGUF %s weights (%d tensors, e.g. %s): dequantized to float32 at load (they load at full precision)",
            type_name,
            len(names),
            names[0],
        )


def _float_array(raw: np.ndarray, t: GGUFTensor, ggml_type, gguf_dequantize) -> np.ndarray:
    if t.type == "F32":
        return raw.view(np.float32).reshape(t.shape)
    if t.type in ("F16", "BF16"):
        return raw.view(np.int16 if t.type == "BF16" else np.float16).reshape(t.shape)  # (BF16: bits, below)
    return gguf_dequantize(raw.reshape(t.shape[:-1] + (-1,)), ggml_type).astype(np.float32, copy=False)


def _to_torch(array: np.ndarray, type_name: str) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.view(torch.bfloat16) if type_name == "BF16" else tensor
