"""AWQ checkpoints (`quant_method: awq`, `version: gemm`), as AutoAWQ writes them.

Per linear [N out, K in], 4 bits, groups of `group_size` input rows, with zero points:
- `qweight` int32 [K, N / 8]: packed along N, eight values per word, lowest bits first, in AWQ's
  interleaved order: the word for columns 8c .. 8c+7 holds, from its lowest field up, columns
  8c + [0, 2, 4, 6, 1, 3, 5, 7] (the order AutoAWQ's GEMM kernel unpacks fastest);
- `qzeros` int32 [G, N / 8]: zero points, packed the same way (stored as they are);
- `scales` float16 [G, N], G = K / group_size;
- `bias` (optional) is a plain tensor, loaded like any bias.
w[n, k] = scales[g, n] * (q[k, n] - zero[g, n]) with g = k // group_size.

Only GEMM is read: `gemv` / `gemv_fast` pack along K in other blocks, and `exllama` / `marlin` are
repackings for those kernels; layers listed in `modules_to_not_convert` arrive as plain weights.
"""

from __future__ import annotations

import torch

from pagoda.engine_core.quantization.base import QuantizationMethod, QuantizedShard
from pagoda.engine_core.quantization.gptq import check_group_size, checked_tensor, unpack_words

BITS = 4
PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field i of a word holds column PACK_ORDER[i] of its eight
# Column j of the eight is in field UNPACK_ORDER[j] (the inverse permutation: 0, 4, 1, 5, 2, 6, 3, 7).
UNPACK_ORDER = tuple(PACK_ORDER.index(j) for j in range(8))


def unpack_awq(words: torch.Tensor, columns: int) -> torch.Tensor:
    """int32 [rows, columns / 8] in AWQ's interleaved order -> values [rows, columns] in column order."""
    fields = unpack_words(words, BITS)  # [rows, words, 8], by field
    return fields[..., list(UNPACK_ORDER)].reshape(words.shape[0], -1)[:, :columns]


class AWQ(QuantizationMethod):
    name = "awq"
    loads_experts = True
    kinds = frozenset({"qweight", "qzeros", "scales"})
    required = kinds

    def __init__(self, group_size: int):
        self.group_size = group_size

    @classmethod
    def from_config(cls, qcfg: dict) -> AWQ:
        version = str(qcfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported: Pagoda loads AWQ 'gemm' checkpoints")
        bits = int(qcfg.get("bits", qcfg.get("w_bit", BITS)))
        if bits != BITS:
            raise ValueError(f"AWQ {bits}-bit weights are not supported: Pagoda loads 4-bit AWQ (gemm)")
        if not qcfg.get("zero_point", True):
            raise ValueError("AWQ without zero points (zero_point: false) is not supported: gemm checkpoints have them")
        group_size = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
        return cls(check_group_size("AWQ", group_size, allow_per_channel=False))

    def from_checkpoint(
        self, name: str, tensors: dict[str, torch.Tensor], out_features: int, in_features: int
    ) -> QuantizedShard:
        n, k = out_features, in_features
        if k % self.group_size:
            raise ValueError(f"{name}: {k} input features are not a multiple of AWQ group_size {self.group_size}")
        groups = k // self.group_size
        words = -(-n // 8)
        qweight = checked_tensor(name, tensors, "qweight", (k, words), torch.int32)
        qzeros = checked_tensor(name, tensors, "qzeros", (groups, words), torch.int32)
        scales = checked_tensor(name, tensors, "scales", (groups, n))
        if not scales.is_floating_point():
            raise ValueError(f"{name}.scales: dtype {scales.dtype}, expected a float type")
        q = unpack_awq(qweight, n)  # [K, N]
        zeros = unpack_awq(qzeros, n)  # [G, N]
        scales_nk = scales.t().float().contiguous()
        # mins = -zero * scale, exact in float32 (an fp16 scale times an integer below 16).
        mins = -zeros.t().float() * scales_nk
        return QuantizedShard(q.t().contiguous(), scales_nk, mins, BITS, self.group_size)

    def describe(self) -> str:
        return f"awq (4-bit, group {self.group_size}, zero points, gemm)"
