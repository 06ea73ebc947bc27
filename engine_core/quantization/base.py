"""What every quantization method shares: the canonical form of one quantized linear, and the interface
a method implements to produce it.

A method is chosen once per model (engine_core/quantization/__init__.py). The loader hands it the
checkpoint tensors of one linear at a time (`q_proj.qweight`, `q_proj.scales`, ... or a plain
`q_proj.weight`); the method answers with a `QuantizedShard` (integers + group scales and mins), an
`Fp8Weight` (FP8 with per-channel scales: kept where the device multiplies in FP8, else dequantized by
the loader) or a float weight (a format dequantized at load). Merged linears (QKV, gate+up) concatenate their shards'
rows, and the result is packed once for the kernels (`pagoda.kernels.quantized.pack`). Model files never see
any of it: they build `Linear`s, and a `Linear` holding a `PackedWeight` computes with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagoda.kernels.fp8 import Fp8Weight
from pagoda.kernels.quantized import BLOCK, PackedWeight, group_size_for, pack


@dataclass
class QuantizedShard:
    """One checkpoint linear [n, K] as integers with group scales: w = scales[g] * q + mins[g]."""

    q: torch.Tensor  # [n, K], integers in [0, 2**bits)
    scales: torch.Tensor  # [n, G] float
    mins: torch.Tensor | None  # [n, G] float; None = symmetric (min = -2**(bits-1) * scale)
    bits: int
    group_size: int  # columns per group; -1 = one group per row
    g_idx: torch.Tensor | None = None  # [K] group of each input column, when not consecutive (act-order)
    # [K'] the input column each stored column reads, when they are not the input's own (an act-order
    # weight split by input columns under tensor parallel: see `shard_columns`)
    input_columns: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [n, K] (tests, and formats compared in float)."""
        k = self.q.shape[1]
        group = k if self.group_size <= 0 else self.group_size
        index = self.g_idx.long() if self.g_idx is not None else torch.arange(k) // group
        scales = self.scales.float()[:, index]
        mins = -float(1 << (self.bits - 1)) * scales if self.mins is None else self.mins.float()[:, index]
        stored = self.q.float() * scales + mins
        if self.input_columns is None:
            return stored
        columns = self.input_columns.long()
        weight = torch.zeros(stored.shape[0], int(columns.max()) + 1)
        return weight.index_add_(1, columns, stored)

    def rows(self, rows: slice) -> QuantizedShard:
        """Output rows `rows` (a column-parallel rank's piece), with their scales and mins."""
        mins = None if self.mins is None else self.mins[rows]
        return QuantizedShard(self.q[rows], self.scales[rows], mins, self.bits, self.group_size, self.g_idx)


class QuantizationMethod:
    """How a model's linears are stored. Subclasses set the class attributes and implement
    `from_checkpoint` (checkpoint formats) or `quantize` (quantization at load)."""

    name: str = ""
    # Checkpoint tensor kinds (the last part of a name: `qweight`, `scales`, ...) of a quantized linear,
    # and which of them must be present; a linear with only `weight` (+ `bias`) is in full precision.
    kinds: frozenset[str] = frozenset()
    required: frozenset[str] = frozenset()
    # Quantize a full-precision weight at load (`--quantization int8|int4|fp8`); otherwise a linear the
    # checkpoint keeps in full precision (an `ignore`d lm_head) stays so.
    quantizes_full_precision: bool = False
    # A mixture of experts' experts load with this method: each expert's projections become integers with
    # group scales, which the fused MoE computes with (kernels/quantized.py `PackedExperts`). FP8 weights
    # have no such layout, so FP8 methods leave it False and the loader refuses MoE models for them.
    loads_experts: bool = False

    def from_checkpoint(
        self, name: str, tensors: dict[str, torch.Tensor], out_features: int, in_features: int
    ) -> QuantizedShard | Fp8Weight | torch.Tensor:
        """One linear's checkpoint tensors (by kind) -> its quantized shard, or a float weight [n, K]."""
        raise NotImplementedError(f"{self.name} checkpoints hold no quantized tensors")

    def quantize(self, name: str, weight: torch.Tensor) -> QuantizedShard | Fp8Weight | torch.Tensor:
        """A full-precision weight [n, K] -> its quantized shard (quantizes_full_precision methods)."""
        raise NotImplementedError(f"{self.name} does not quantize at load")

    def describe(self) -> str:
        """One line for the start-up log and /v1/models, e.g. `gptq (4-bit, group 128)`."""
        return self.name


def shard_columns(name: str, shard: QuantizedShard, start: int, stop: int, world_size: int) -> QuantizedShard:
    """Input columns [start, stop) of `shard` with their groups' scales and mins: a row-parallel rank's
    piece. Groups must not straddle ranks (else a ValueError naming group and tensor-parallel sizes);
    one group per row keeps its scale on every rank. Act-order groups are scattered over the columns,
    so they are regrouped (`_act_order_columns`)."""
    k = shard.q.shape[1]
    if shard.g_idx is not None:
        return _act_order_columns(name, shard, start, stop)
    q = shard.q[:, start:stop]
    group = shard.group_size
    if group <= 0 or group >= k:
        return QuantizedShard(q, shard.scales, shard.mins, shard.bits, -1)
    if start % group or (stop % group and stop != k):
        raise ValueError(
            f"{name}: tensor-parallel size {world_size} gives each rank {stop - start} of its {k} input columns, "
            f"which is not a multiple of its quantization group size {group}; choose a tensor-parallel size "
            "that keeps the groups whole"
        )
    groups = slice(start // group, -(-stop // group))
    mins = None if shard.mins is None else shard.mins[:, groups]
    return QuantizedShard(q, shard.scales[:, groups], mins, shard.bits, group)


def _act_order_columns(name: str, shard: QuantizedShard, start: int, stop: int) -> QuantizedShard:
    """Columns [start, stop) of an act-order shard. Its groups are scattered over the input columns, so
    a rank holds part of every group: its columns are ordered by group and each group's are padded to
    whole 32-column blocks (the kernels' group unit) with columns that weigh exactly zero (q = the value
    whose scale * q + min is 0: the zero point), each block carrying its group's scale and min.
    `input_columns` then names the input column each stored column reads (pads read any)."""
    n = shard.q.shape[0]
    assert shard.g_idx is not None
    scales = shard.scales.float()
    mins = -float(1 << (shard.bits - 1)) * scales if shard.mins is None else shard.mins.float()
    zero = torch.round(-mins / scales)
    exact = (zero * scales + mins).abs() <= 1e-6 * scales.abs()
    if not bool(exact.all()) or int(zero.min()) < 0 or int(zero.max()) >= 1 << shard.bits:
        raise ValueError(f"{name}: act-order groups without an integer zero point cannot be split by input columns")
    local_groups = shard.g_idx[start:stop].long()
    order = torch.argsort(local_groups, stable=True)
    group_ids, counts = torch.unique_consecutive(local_groups[order], return_counts=True)
    q_local = shard.q[:, start:stop]
    columns, q_parts, scale_parts, min_parts = [], [], [], []
    first = 0
    for g, count in zip(group_ids.tolist(), counts.tolist(), strict=True):
        cols = order[first : first + count]
        first += count
        blocks = -(-count // BLOCK)
        pad = blocks * BLOCK - count
        columns.append(torch.cat([cols, cols[:1].expand(pad)]))
        q_parts.append(torch.cat([q_local[:, cols], zero[:, g : g + 1].to(q_local.dtype).expand(n, pad)], dim=1))
        scale_parts.append(scales[:, g : g + 1].expand(n, blocks))
        min_parts.append(mins[:, g : g + 1].expand(n, blocks))
    return QuantizedShard(
        torch.cat(q_parts, dim=1),
        torch.cat(scale_parts, dim=1).contiguous(),
        torch.cat(min_parts, dim=1).contiguous(),
        shard.bits,
        BLOCK,
        input_columns=torch.cat(columns),
    )


def pack_shards(name: str, shards: list[QuantizedShard]) -> PackedWeight:
    """Concatenate the rows of a merged linear's shards and pack them for the kernels."""
    shards = _common_layout(shards)
    first = shards[0]
    for shard in shards[1:]:
        if (shard.bits, shard.group_size) != (first.bits, first.group_size):
            raise ValueError(
                f"{name}: merged projections are quantized differently ({first.bits}-bit group "
                f"{first.group_size} vs {shard.bits}-bit group {shard.group_size})"
            )
        same_order = (shard.g_idx is None and first.g_idx is None) or (
            shard.g_idx is not None and first.g_idx is not None and torch.equal(shard.g_idx, first.g_idx)
        )
        if not same_order:
            raise ValueError(f"{name}: merged projections have different act-order (g_idx); not supported")
    q = torch.cat([s.q for s in shards]) if len(shards) > 1 else first.q
    scales = torch.cat([s.scales.float() for s in shards]) if len(shards) > 1 else first.scales.float()
    if all(s.mins is None for s in shards):
        mins = None
    else:
        offset = -float(1 << (first.bits - 1))
        mins = torch.cat([s.scales.float() * offset if s.mins is None else s.mins.float() for s in shards])
    k = q.shape[1]
    group = k if first.group_size <= 0 else first.group_size
    if first.input_columns is not None:  # (a row-parallel piece: never merged with another)
        return pack(q, scales, mins, first.bits, first.group_size, first.input_columns)
    perm = None
    g_idx = first.g_idx
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
        # Act-order: reorder the columns so each group's are adjacent; the layer permutes its input.
        perm = torch.argsort(g_idx.long(), stable=True)
        counts = torch.bincount(g_idx.long(), minlength=scales.shape[1])
        if bool((counts[:-1] != group).any()) or int(counts[-1]) > group:
            raise ValueError(f"{name}: g_idx does not give every group {group} columns; not supported")
        q = q[:, perm]
    return pack(q, scales, mins, first.bits, first.group_size, perm, name=name)


# The packed layout stores scales and mins in float16 (kernels/quantized.py). A quantizer that picks
# them itself (at load, GGUF's Q6_K) rounds them to float16 first, in the direction that keeps every
# weight within the range they cover, and then rounds the weights against the values actually stored.
FLOAT16_SMALLEST = 2.0**-24  # the smallest positive float16 (a subnormal): a scale never below it


def float16_ceil(values: torch.Tensor) -> torch.Tensor:
    """The smallest float16 at least each value, as float32 (beyond float16's range: inf, which
    `pack` then refuses with the layer's name)."""
    half = values.to(torch.float16)
    below = half.float() < values
    return torch.where(below, torch.nextafter(half, torch.full_like(half, float("inf"))), half).float()


def float16_floor(values: torch.Tensor) -> torch.Tensor:
    """The largest float16 at most each value, as float32."""
    half = values.to(torch.float16)
    above = half.float() > values
    return torch.where(above, torch.nextafter(half, torch.full_like(half, float("-inf"))), half).float()


def _common_layout(shards: list[QuantizedShard]) -> list[QuantizedShard]:
    """Shards of one merged linear stored alike, where that is lossless: GGUF files mix types within a
    layer (Q4_K_M keeps v_proj in Q6_K next to Q4_K q/k_proj), so 4-bit shards are widened to 8 bits
    (same integers, same scales and mins) and groups are split down to the smallest group size (each
    scale repeated). Act-order shards are left as they are (pack_shards refuses a mix)."""
    layouts = {(s.bits, s.group_size) for s in shards}
    if len(layouts) == 1 or any(s.g_idx is not None for s in shards):
        return shards
    k = shards[0].q.shape[1]
    groups = [group_size_for(k, s.group_size) for s in shards]
    group = math.gcd(*groups)
    bits = max(s.bits for s in shards)
    widened = []
    for shard, own in zip(shards, groups, strict=True):
        scales, mins = shard.scales.float(), shard.mins
        if mins is None:  # symmetric: its min depends on the bit width, so write it out
            mins = -float(1 << (shard.bits - 1)) * scales
        if own != group:
            count = -(-k // group)
            scales = scales.repeat_interleave(own // group, dim=1)[:, :count]
            mins = mins.float().repeat_interleave(own // group, dim=1)[:, :count]
        widened.append(QuantizedShard(shard.q, scales, mins, bits, group))
    return widened
