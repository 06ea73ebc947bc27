"""GPTQ checkpoints (`quant_method: gptq`), as GPTQModel and AutoGPTQ write them.

Per linear [N out, K in], with `pf = 32 // bits` values per int32 word, lowest bits first:
- `qweight` int32 [K / pf, N]: packed along K (word r of column n holds rows r*pf .. r*pf + pf-1);
- `qzeros` int32 [G, N / pf]: zero points, packed along N the same way;
- `scales` float16 [G, N], G = ceil(K / group_size) (one group when group_size is -1);
- `g_idx` int32 [K]: the group of each input row: k // group_size, or a permutation of it when the
  checkpoint was quantized in activation order (`desc_act`);
- `bias` (optional) is a plain tensor, loaded like any bias.
w[n, k] = scales[g, n] * (q[k, n] - zero[g, n]) with g = g_idx[k].

Zero points: `checkpoint_format: gptq` (v1, AutoGPTQ's and GPTQModel's default) stores each zero point
minus one. GPTQModel subtracts one from every field of a packed word in a single int32 subtraction
(0x11111111 for 4 bits), so a zero point of 0 borrows from the field above it; its own loader undoes
that with the matching addition on the whole word, and so do we (adding one per field after unpacking
would be wrong exactly where a borrow happened). `gptq_v2` stores the zero points as they are.
Symmetric checkpoints have every zero point at 2**(bits-1) (8 for 4 bits, 128 for 8 bits).
"""

from __future__ import annotations

import torch

from pagoda.engine_core.quantization.base import QuantizationMethod, QuantizedShard
from pagoda.kernels.quantized import BLOCK

SUPPORTED_BITS = (4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")  # v1 (zero points stored minus one), v2 (stored as they are)
# Added to each packed qzeros word of a v1 checkpoint: one in every field.
_V1_ZERO_OFFSET = {4: 0x11111111, 8: 0x01010101}


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """The `32 // bits` unsigned values of each int32 word, lowest bits first, along a new last dim."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    values = (words.to(torch.int64) & 0xFFFFFFFF).unsqueeze(-1) >> shifts
    return (values & ((1 << bits) - 1)).to(torch.int32)


def check_group_size(method: str, group_size: int, allow_per_channel: bool) -> int:
    if group_size == -1 and allow_per_channel:
        return -1
    if group_size <= 0 or group_size % BLOCK:
        per_channel = " or -1 (one group per output channel)" if allow_per_channel else ""
        raise ValueError(
            f"{method} group_size {group_size} is not supported: use a positive multiple of {BLOCK}{per_channel}"
        )
    return group_size


def checked_tensor(name: str, tensors: dict[str, torch.Tensor], kind: str, shape: tuple[int, ...], dtype=None):
    tensor = tensors[kind]
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}.{kind}: shape {tuple(tensor.shape)}, expected {shape} for this layer")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"{name}.{kind}: dtype {tensor.dtype}, expected {dtype}")
    return tensor


class GPTQ(QuantizationMethod):
    name = "gptq"
    loads_experts = True
    kinds = frozenset({"qweight", "qzeros", "scales", "g_idx"})
    required = frozenset({"qweight", "qzeros", "scales"})  # without g_idx, groups are consecutive

    def __init__(self, bits: int, group_size: int, sym: bool, desc_act: bool, checkpoint_format: str):
        self.bits = bits
        self.group_size = group_size
        self.sym = sym
        self.desc_act = desc_act
        self.checkpoint_format = checkpoint_format

    @classmethod
    def from_config(cls, qcfg: dict) -> GPTQ:
        bits = int(qcfg.get("bits", 4))
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"GPTQ {bits}-bit weights are not supported: Pagoda loads 4- and 8-bit GPTQ checkpoints")
        group_size = check_group_size("GPTQ", int(qcfg.get("group_size", 128)), allow_per_channel=True)
        if qcfg.get("is_marlin_format"):
            raise ValueError("GPTQ checkpoints in Marlin format are not supported: Pagoda loads gptq and gptq_v2")
        fmt = str(qcfg.get("checkpoint_format") or qcfg.get("format") or "gptq").lower()
        if fmt not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"GPTQ checkpoint_format {fmt!r} is not supported: Pagoda loads {' and '.join(CHECKPOINT_FORMATS)}"
            )
        pack_dtype = str(qcfg.get("pack_dtype", "int32")).removeprefix("torch.")
        if pack_dtype != "int32":
            raise ValueError(f"GPTQ pack_dtype {pack_dtype!r} is not supported: Pagoda loads int32-packed GPTQ")
        # GPTQModel's per-module overrides: "-:pattern" only leaves modules unquantized (they arrive as
        # plain weights and load as such); any other override changes bits or groups per module.
        overrides = [key for key in (qcfg.get("dynamic") or {}) if not str(key).startswith("-:")]
        if overrides:
            raise ValueError(f"GPTQ per-module overrides (dynamic: {overrides}) are not supported")
        return cls(bits, group_size, bool(qcfg.get("sym", True)), bool(qcfg.get("desc_act", False)), fmt)

    def from_checkpoint(
        self, name: str, tensors: dict[str, torch.Tensor], out_features: int, in_features: int
    ) -> QuantizedShard:
        bits, n, k = self.bits, out_features, in_features
        per_word = 32 // bits
        groups = 1 if self.group_size == -1 else -(-k // self.group_size)
        qweight = checked_tensor(name, tensors, "qweight", (-(-k // per_word), n), torch.int32)
        qzeros = checked_tensor(name, tensors, "qzeros", (groups, -(-n // per_word)), torch.int32)
        scales = checked_tensor(name, tensors, "scales", (groups, n))
        if not scales.is_floating_point():
            raise ValueError(f"{name}.scales: dtype {scales.dtype}, expected a float type")

        q = unpack_words(qweight, bits).permute(0, 2, 1).reshape(-1, n)[:k]  # [K, N]
        words = qzeros.to(torch.int64)
        if self.checkpoint_format == "gptq":
            words = words + _V1_ZERO_OFFSET[bits]  # unpack_words keeps the low 32 bits
        zeros = unpack_words(words, bits).reshape(groups, -1)[:, :n]  # [G, N]

        g_idx = None
        if "g_idx" in tensors:
            g_idx = checked_tensor(name, tensors, "g_idx", (k,)).to(torch.int64)
            if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
                raise ValueError(f"{name}.g_idx: groups outside [0, {groups})")
            consecutive = torch.arange(k) // (k if self.group_size == -1 else self.group_size)
            if torch.equal(g_idx, consecutive):
                g_idx = None  # the plain order: no permutation to carry

        scales_nk = scales.t().float().contiguous()
        zeros_nk = zeros.t()
        # mins = -zero * scale, exact in float32 (an fp16 scale times an integer below 2**8).
        symmetric = bool((zeros_nk == 1 << (bits - 1)).all())
        mins = None if symmetric else -zeros_nk.float() * scales_nk
        return QuantizedShard(q.t().contiguous(), scales_nk, mins, bits, self.group_size, g_idx)

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        details = [f"{self.bits}-bit", group, "symmetric" if self.sym else "zero points"]
        if self.desc_act:
            details.append("act-order")
        return f"gptq ({', '.join(details)})"
