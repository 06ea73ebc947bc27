"""Weight-only quantized linear layers: one packed layout for every checkpoint format, and its matmul.

Every format (GPTQ, AWQ, compressed-tensors, GGUF, quantization at load) is turned by the engine into
integers `q[n, k]` in `[0, 2**bits)` plus one `scale` and one `min` per (output row, group of input
columns), with `w[n, k] = scale[n, g] * q[n, k] + min[n, g]` (symmetric formats: `min = -2**(bits-1) *
scale`; zero points: `min = -zero * scale`). `pack` stores that as a `PackedWeight`:

- 4 bits: `data` uint8 `[N, Kp // 2]`, `Kp` = K rounded up to 32. Each block of 32 columns takes 16
  bytes; byte j holds column j in its low nibble and column j + 16 in its high one (GGUF's Q4_0/Q4_1
  order, so those blocks are copied, not recomputed). A 32-column block fills a vector of 8-bit lanes
  after one mask and one shift.
- 8 bits: `data` int8 `[N, Kp]` holding `q - 128`; `min` then becomes `min + 128 * scale`, which is
  exactly zero for symmetric weights, and is dropped (`mins is None`) when it is zero everywhere.
- `scales`, `mins`: float32 `[N, G]`, G = ceil(K / group_size); group_size is a multiple of 32 (a
  per-channel scale is one group of K). Columns past K in the last block are zero and never read.
- `perm` (act-order GPTQ): the layer computes `x[..., perm] @ W'^T`, where W' holds the original
  columns in `perm` order, so that each group's columns are adjacent.

`quantized_linear` dispatches like the other kernels: the compiled C kernel on the CPU where it
builds, Triton on CUDA, and `reference_linear` (dequantize a slice of rows at a time, then matmul)
everywhere else; the reference never holds a dequantized copy of the whole weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # columns per packed block; every group size is a multiple of it
_REFERENCE_ROWS = 1024  # output rows dequantized at a time by the reference matmul


@dataclass
class PackedWeight:
    bits: int  # 4 or 8
    out_features: int  # N
    in_features: int  # K
    group_size: int  # columns per scale; a multiple of BLOCK (a per-channel scale: K rounded up)
    data: torch.Tensor  # uint8 [N, Kp/2] (4 bits) or int8 [N, Kp] (8 bits)
    scales: torch.Tensor  # float32 [N, G]
    mins: torch.Tensor | None  # float32 [N, G]; None: zero
    perm: torch.Tensor | None = None  # int64 [K]: input column order (act-order)

    @property
    def padded_in_features(self) -> int:
        return -(-self.in_features // BLOCK) * BLOCK

    @property
    def num_groups(self) -> int:
        return -(-self.in_features // self.group_size)

    def nbytes(self) -> int:
        tensors = [self.data, self.scales, self.mins, self.perm]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def to(self, device: torch.device) -> PackedWeight:
        def move(t):
            return None if t is None else t.to(device)

        return PackedWeight(
            self.bits,
            self.out_features,
            self.in_features,
            self.group_size,
            self.data.to(device),
            self.scales.to(device),
            move(self.mins),
            move(self.perm),
        )


def group_size_for(in_features: int, group_size: int) -> int:
    """The stored group size: -1 or anything at least K means one group per row (K rounded up to a
    block); otherwise it must be a positive multiple of BLOCK."""
    if group_size <= 0 or group_size >= in_features:
        return -(-in_features // BLOCK) * BLOCK
    if group_size % BLOCK:
        raise ValueError(f"group size {group_size} is not supported: use a multiple of {BLOCK}, or -1 (per channel)")
    return group_size


def pack(
    q: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    group_size: int,
    perm: torch.Tensor | None = None,
) -> PackedWeight:
    """Pack integers `q` [N, K] in [0, 2**bits) with their float `scales`/`mins` [N, G] (mins None:
    symmetric around zero, i.e. -2**(bits-1) * scale)."""
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit weights are not supported: use 4 or 8")
    n, k = q.shape
    group = group_size_for(k, group_size)
    groups = -(-k // group)
    if scales.shape != (n, groups):
        raise ValueError(f"scales have shape {tuple(scales.shape)}, expected {(n, groups)} for group size {group}")
    q = q.to(torch.int32)
    if int(q.min()) < 0 or int(q.max()) >= 1 << bits:
        raise ValueError(f"quantized values outside [0, {1 << bits})")
    scales = scales.to(torch.float32).contiguous()
    mins = (-float(1 << (bits - 1)) * scales) if mins is None else mins.to(torch.float32)
    if mins.shape != scales.shape:
        raise ValueError(f"mins have shape {tuple(mins.shape)}, expected {tuple(scales.shape)}")
    padded = -(-k // BLOCK) * BLOCK
    # Padding columns hold 0: kernels never multiply them (they stop at K).
    q = torch.nn.functional.pad(q, (0, padded - k))
    if bits == 4:
        blocks = q.reshape(n, padded // BLOCK, 2, BLOCK // 2)
        data = (blocks[:, :, 0, :] | (blocks[:, :, 1, :] << 4)).to(torch.uint8).reshape(n, padded // 2)
        stored_mins: torch.Tensor | None = mins.contiguous()
    else:
        data = (q - 128).to(torch.int8)
        shifted = mins + 128.0 * scales
        stored_mins = shifted.contiguous() if bool(shifted.any()) else None
    if perm is not None:
        perm = perm.to(torch.int64).contiguous()
        if perm.shape != (k,):
            raise ValueError(f"perm has shape {tuple(perm.shape)}, expected ({k},)")
    return PackedWeight(bits, n, k, group, data.contiguous(), scales, stored_mins, perm)


def unpack(packed: PackedWeight, rows: slice | torch.Tensor | None = None) -> torch.Tensor:
    """The integers `q` [N, K] in [0, 2**bits) of the chosen rows (inverse of `pack`)."""
    data = packed.data if rows is None else packed.data[rows]
    k = packed.in_features
    if packed.bits == 4:
        blocks = data.reshape(data.shape[0], -1, BLOCK // 2).to(torch.int32)
        q = torch.cat([blocks & 15, blocks >> 4], dim=-1).reshape(data.shape[0], -1)
    else:
        q = data.to(torch.int32) + 128
    return q[:, :k]


def dequantize(packed: PackedWeight, rows: slice | torch.Tensor | None = None, dtype=torch.float32) -> torch.Tensor:
    """W' [rows, K] in float (columns in `perm` order when there is one): scale * stored + min, where
    stored is q for 4 bits and q - 128 for 8 bits (whose stored min already holds min + 128 * scale)."""
    data = packed.data if rows is None else packed.data[rows]
    if packed.bits == 4:
        stored = unpack(packed, rows).to(torch.float32)
    else:
        stored = data[:, : packed.in_features].to(torch.float32)
    scales = packed.scales if rows is None else packed.scales[rows]
    w = stored * scales.repeat_interleave(packed.group_size, dim=1)[:, : packed.in_features]
    if packed.mins is not None:
        mins = packed.mins if rows is None else packed.mins[rows]
        w += mins.repeat_interleave(packed.group_size, dim=1)[:, : packed.in_features]
    return w.to(dtype)


def dequantize_original_order(packed: PackedWeight, dtype=torch.float32) -> torch.Tensor:
    """W [N, K] with the checkpoint's column order (perm undone): what a full-precision layer would hold."""
    w = dequantize(packed, dtype=dtype)
    if packed.perm is None:
        return w
    original = torch.empty_like(w)
    original[:, packed.perm] = w
    return original


def embedding_rows(packed: PackedWeight, ids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Rows `ids` of the dequantized weight in the original column order: an embedding lookup in a
    quantized table (a tied LM head), without dequantizing the rest."""
    w = dequantize(packed, ids.reshape(-1), dtype)
    if packed.perm is not None:
        original = torch.empty_like(w)
        original[:, packed.perm] = w
        w = original
    return w.reshape(*ids.shape, packed.in_features)


def reference_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) by dequantizing `_REFERENCE_ROWS` output rows at a time."""
    if packed.perm is not None:
        x = x.index_select(-1, packed.perm)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], packed.out_features, dtype=x.dtype, device=x.device)
    for start in range(0, packed.out_features, _REFERENCE_ROWS):
        stop = min(start + _REFERENCE_ROWS, packed.out_features)
        w = dequantize(packed, slice(start, stop), dtype=x.dtype)
        torch.matmul(rows, w.t(), out=out[:, start:stop])
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], packed.out_features)
