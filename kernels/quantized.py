"""Weight-only quantized linear layers: one packed layout for every checkpoint format, and its matmul.

Every format (GPTQ, AWQ, compressed-tensors, GGUF, quantization at load) is turned by the engine into
integers `q[n, k]` in `[0, 2**bits)` plus one `scale` and one `min` per (output row, group of input
columns), with `w[n, k] = scale[n, g] * q[n, k] + min[n, g]` (symmetric formats: `min = -2**(bits-1) *
scale`; zero points: `min = -zero * scale`). `pack` stores that as a `PackedWeight`:

- 4 bits: `data` uint8 `[N, Kp // 2]`, `Kp` = K rounded up to 32. Each block of 32 columns takes 16
  bytes; byte j holds column j in its low nibble and column j + 16 in its high one (GGUF's Q4_0/Q4_1
  order, so those blocks are copied, not recomputed). A 32-column block fills a vector of 8-bit lanes
  after one mask and one shift.
- 8 bits: `data` int8 `[N, Kp]` holding `q - 128`. The kernels multiply that stored value, so the
  term they add per group is `min + 128 * scale` (`offsets`), computed in float32 from the stored
  scale and min: it is zero for symmetric weights, whose `mins` are then dropped (`None`). The min
  itself is stored, not that sum: the sum needs more bits (with Q5_0's min -16d it is 112d).
- `scales`: float16 `[N, G]`, G = ceil(K / group_size); group_size is a multiple of 32 (a per-channel
  scale is one group of K). Columns past K in the last block are zero and never read. Why float16:
  memory. With float32 scales and mins a 32-column 4-bit group took 16 + 8 bytes; with float16 ones it
  takes 16 + 4, like GGUF's Q4_1 (whose d and m are float16, copied exactly), which is what puts
  grouped INT4 under 0.2x of float32. Checkpoints' scales are float16 or bfloat16 values (copied
  exactly) wherever the model was saved in half precision; a float32 scale is rounded, by at most
  2**-11 of itself (1/2048 of a quantization step); the quantizers at load choose float16 values.
  A scale beyond float16's range (|v| > 65504) is refused by `pack`, naming the layer; tiny ones
  (below 2**-14) are kept as float16 subnormals, absolute error at most 2**-25 (those below 2**-25
  become zero): weights that small contribute nothing measurable.
- `mins`: `[N, G]`, float16 when that holds every min of the layer exactly (GGUF's m, -8d and -16d,
  symmetric weights' -8 scales, the mins chosen at load), float32 otherwise. Zero points are why:
  GPTQ's and AWQ's min = -zero * scale needs up to 11 + 8 bits, and rounded to float16 it would move
  every weight of a group by up to 2**-11 of the min (1/16 of an 8-bit step): enough to change greedy
  tokens against the checkpoint's own weights. (2 more bytes per group: 70 instead of 68 per 128
  4-bit columns.) `mins` is `None` only for symmetric 8-bit weights; 4-bit ones always store theirs.
- `perm` (act-order GPTQ): the layer computes `x[..., perm] @ W'^T`, where W' holds the original
  columns in `perm` order, so that each group's columns are adjacent.

A mixture-of-experts layer's stacked expert matrices are quantized expert by expert like dense linears and
stored as one `PackedExperts`: every expert's `PackedWeight` tensors stacked along a first dimension (one
layout for all experts), read by the fused MoE kernel (kernels/cpu/moe.c) one chosen expert at a time.

`quantized_linear` dispatches like the other kernels: the compiled C kernel on the CPU where it
builds, Triton on CUDA, and `reference_linear` (dequantize a slice of rows at a time, then matmul)
everywhere else; the reference never holds a dequantized copy of the whole weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # columns per packed block; every group size is a multiple of it
FLOAT16_MAX = 65504.0  # the largest finite float16: scales beyond it are refused
_REFERENCE_ROWS = 1024  # output rows dequantized at a time by the reference matmul


@dataclass
class PackedWeight:
    bits: int  # 4 or 8
    out_features: int  # N
    in_features: int  # K
    group_size: int  # columns per scale; a multiple of BLOCK (a per-channel scale: K rounded up)
    data: torch.Tensor  # uint8 [N, Kp/2] (4 bits) or int8 [N, Kp] (8 bits)
    scales: torch.Tensor  # float16 [N, G]
    mins: torch.Tensor | None  # float16 (or float32: not float16 values) [N, G]; None: symmetric 8-bit
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


@dataclass
class PackedExperts:
    """Stacked expert matrices `W [E, N, K]`, each expert's a `PackedWeight` of one common layout (bits, group
    size, mins' dtype; no `perm`), its tensors stacked: `data [E, ...]`, `scales [E, N, G]`, `mins [E, N, G]`.
    Where some experts store mins and others do not (symmetric 8-bit ones), all store them (`_common_mins`)."""

    bits: int
    out_features: int  # N, per expert
    in_features: int  # K
    group_size: int
    data: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @classmethod
    def stack(cls, name: str, experts: list[PackedWeight]) -> PackedExperts:
        """One `PackedExperts` from each expert's packed weight (`name`, the layer, names the errors)."""
        first = experts[0]
        _check_one_layout(name, experts, first.out_features)
        mins = _common_mins(experts)
        data, scales = torch.stack([w.data for w in experts]), torch.stack([w.scales for w in experts])
        return cls(
            first.bits,
            first.out_features,
            first.in_features,
            first.group_size,
            data,
            scales,
            None if mins is None else torch.stack(mins),
        )

    @property
    def num_experts(self) -> int:
        return self.data.shape[0]

    def expert(self, index: int) -> PackedWeight:
        """Expert `index`'s packed weight (views of the stacked tensors)."""
        mins = None if self.mins is None else self.mins[index]
        return PackedWeight(
            self.bits, self.out_features, self.in_features, self.group_size, self.data[index], self.scales[index], mins
        )

    def matrix(self, index: int, dtype=torch.float32) -> torch.Tensor:
        """Expert `index`'s matrix `[N, K]`, dequantized (that expert's only)."""
        return dequantize(self.expert(index), dtype=dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.mins) if t is not None)


def concat_rows(name: str, parts: list[PackedWeight]) -> PackedWeight:
    """The rows of `parts` (one layout, no `perm`) as one packed weight: an expert's gate and up
    projections, quantized apart, as its gate-then-up matrix."""
    _check_one_layout(name, parts, None)
    mins = _common_mins(parts)
    first = parts[0]
    return PackedWeight(
        first.bits,
        sum(p.out_features for p in parts),
        first.in_features,
        first.group_size,
        torch.cat([p.data for p in parts]),
        torch.cat([p.scales for p in parts]),
        None if mins is None else torch.cat(mins),
    )


def _check_one_layout(name: str, weights: list[PackedWeight], out_features: int | None) -> None:
    first = weights[0]
    for weight in weights:
        if (weight.bits, weight.in_features, weight.group_size) != (first.bits, first.in_features, first.group_size):
            raise ValueError(f"{name}: experts are quantized differently; the fused MoE takes one layout")
        if out_features is not None and weight.out_features != out_features:
            raise ValueError(f"{name}: experts have {weight.out_features} and {out_features} output rows")
        if weight.perm is not None:
            raise ValueError(f"{name}: act-order (permuted) expert weights are not supported")


def _common_mins(weights: list[PackedWeight]) -> list[torch.Tensor] | None:
    """Each weight's mins in one dtype, or None where none stores any. A weight without mins (symmetric
    8-bit) gets its implicit ones, -128 * scale (its offsets stay zero); float16 mins become float32 where
    another weight's are float32."""
    if all(w.mins is None for w in weights):
        return None
    each = [_compact(-float(1 << (w.bits - 1)) * w.scales.float()) if w.mins is None else w.mins for w in weights]
    wide = any(m.dtype == torch.float32 for m in each)
    return [m.float() if wide else m for m in each]


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
    name: str = "weight",
) -> PackedWeight:
    """Pack integers `q` [N, K] in [0, 2**bits) with their float `scales`/`mins` [N, G] (mins None:
    symmetric around zero, i.e. -2**(bits-1) * scale). Scales are stored in float16, mins in float16
    when that holds every one exactly and in float32 otherwise (see the module docstring); `name` (the
    layer) names the error when a scale does not fit float16."""
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
    if mins is not None and mins.shape != scales.shape:
        raise ValueError(f"mins have shape {tuple(mins.shape)}, expected {tuple(scales.shape)}")
    half_scales = _float16(name, "scale", scales)
    symmetric = -float(1 << (bits - 1)) * half_scales.float()  # exact: a power of two times a float16
    full_mins = symmetric if mins is None else _finite(name, "min", mins.to(torch.float32))
    padded = -(-k // BLOCK) * BLOCK
    # Padding columns hold 0: kernels never multiply them (they stop at K).
    q = torch.nn.functional.pad(q, (0, padded - k))
    stored_mins: torch.Tensor | None
    if bits == 4:
        blocks = q.reshape(n, padded // BLOCK, 2, BLOCK // 2)
        data = (blocks[:, :, 0, :] | (blocks[:, :, 1, :] << 4)).to(torch.uint8).reshape(n, padded // 2)
        stored_mins = _compact(full_mins)
    else:
        data = (q - 128).to(torch.int8)
        # min + 128 * scale zero everywhere (symmetric weights): no mins at all
        stored_mins = None if torch.equal(full_mins, symmetric) else _compact(full_mins)
    if perm is not None:
        perm = perm.to(torch.int64).contiguous()
        if perm.shape != (k,):
            raise ValueError(f"perm has shape {tuple(perm.shape)}, expected ({k},)")
    return PackedWeight(bits, n, k, group, data.contiguous(), half_scales, stored_mins, perm)


def _finite(name: str, what: str, values: torch.Tensor) -> torch.Tensor:
    if values.numel() and not bool(torch.isfinite(values).all()):
        raise ValueError(f"{name}: a {what} is not finite (inf or nan): the quantized weight is corrupt")
    return values


def _float16(name: str, what: str, values: torch.Tensor) -> torch.Tensor:
    """`values` rounded to float16 (to nearest), refusing what float16 cannot hold."""
    values = _finite(name, what, values.to(torch.float32))
    largest = float(values.abs().max()) if values.numel() else 0.0
    if largest > FLOAT16_MAX:
        raise ValueError(
            f"{name}: a {what} of {largest:g} is outside float16's range (|{what}| <= {FLOAT16_MAX:g}), "
            f"in which quantized weights store their {what}s"
        )
    return values.to(torch.float16).contiguous()


def _compact(mins: torch.Tensor) -> torch.Tensor:
    """Float32 mins as float16 where that changes none of them (beyond float16's range it would: inf),
    else as they are."""
    half = mins.to(torch.float16)
    return half.contiguous() if torch.equal(half.float(), mins) else mins.contiguous()


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


def offsets(packed: PackedWeight, rows: slice | torch.Tensor | None = None) -> torch.Tensor | None:
    """The float32 term [rows, G] each group adds to scale * stored integer: the min for 4 bits, min +
    128 * scale for 8 bits (their stored integer is q - 128), computed in float32 as the kernels do;
    None where it is zero (symmetric 8-bit weights)."""
    if packed.mins is None:
        return None
    mins = (packed.mins if rows is None else packed.mins[rows]).float()
    if packed.bits == 4:
        return mins
    scales = (packed.scales if rows is None else packed.scales[rows]).float()
    return mins + 128.0 * scales


def dequantize(packed: PackedWeight, rows: slice | torch.Tensor | None = None, dtype=torch.float32) -> torch.Tensor:
    """W' [rows, K] in float (columns in `perm` order when there is one): scale * stored + offset, where
    stored is q for 4 bits and q - 128 for 8 bits (see `offsets`)."""
    data = packed.data if rows is None else packed.data[rows]
    if packed.bits == 4:
        stored = unpack(packed, rows).to(torch.float32)
    else:
        stored = data[:, : packed.in_features].to(torch.float32)
    scales = (packed.scales if rows is None else packed.scales[rows]).float()
    w = stored * scales.repeat_interleave(packed.group_size, dim=1)[:, : packed.in_features]
    offset = offsets(packed, rows)
    if offset is not None:
        w += offset.repeat_interleave(packed.group_size, dim=1)[:, : packed.in_features]
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
