"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, what llmcompressor writes).

config.json's `quantization_config` holds `config_groups` (each a scheme: `targets`, `weights`,
`input_activations`, and its `format`), a model-wide `format`, and `ignore` (modules left in full
precision, typically lm_head: their checkpoint tensor is a plain `weight`, which the assembler keeps in
full precision). `weights` is `{num_bits, type: int|float, symmetric, strategy: tensor|channel|group|
block, group_size, block_structure, actorder}`. Three formats are read:

- `pack-quantized` (W4A16, W8A16): `weight_packed` int32 [N, ceil(K * bits / 32)] with 32 / bits
  values per word, value j of a word in bits [j * bits, (j + 1) * bits), each stored as q + 2**(bits-1)
  (q the signed quantized value); `weight_shape` [N, K]; `weight_scale` [N, G] (group), [N, 1]
  (channel) or one value (tensor); asymmetric schemes add `weight_zero_point`, the signed zero points
  offset the same way and packed along the output dimension ([ceil(N * bits / 32), G] int32). The
  weight is scale * (q - zero_point). -> a QuantizedShard: the stored unsigned values are our integers,
  and min = -(zero_point + 2**(bits-1)) * scale.
- `int-quantized` (W8A8 INT8): `weight` int8 [N, K] (q itself) + `weight_scale` (+ `weight_zero_point`
  int8 when asymmetric). The recipe also quantizes activations per token at run time: that is a kernel's
  choice, and here activations stay in float, so it is served as weight-only INT8 (said in the log).
- `float-quantized` (FP8 W8A8): `weight` float8_e4m3fn + `weight_scale` per tensor, per channel or per
  block -> FP8 matmuls where they run, else dequantized at load to the compute dtype (fp8.py says where).

Only one weight scheme per model is read (all config groups quantizing weights alike, which is what
llmcompressor recipes write); a checkpoint mixing schemes per layer is refused, as are activation
ordering with `weight_g_idx`, sparsity, transforms and KV-cache quantization. A mixture of experts' experts
load in the integer formats (each expert's tensors converted as a dense linear's: engine_core/models/moe.py);
FP8 experts are refused (loader.py).
"""

from __future__ import annotations

import logging

import torch

from pagoda.engine_core.quantization.base import QuantizationMethod, QuantizedShard
from pagoda.engine_core.quantization.fp8 import BLOCKS_DEQUANTIZED, FP8_PATH, fp8_weight
from pagoda.kernels.fp8 import Fp8Weight
from pagoda.kernels.quantized import BLOCK

logger = logging.getLogger(__name__)

FORMATS = ("pack-quantized", "int-quantized", "float-quantized")
INT_STRATEGIES = ("tensor", "channel", "group")
FLOAT_STRATEGIES = ("tensor", "channel", "block")


def unpack_int32(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The unsigned `bits`-bit values [rows, count] packed 32 / bits to an int32 along the last dimension,
    value j of each word in its bits [j * bits, (j + 1) * bits)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = values.reshape(packed.shape[0], packed.shape[1] * per_word)
    if values.shape[1] < count:
        raise ValueError(f"{packed.shape[1]} packed words hold {values.shape[1]} values, fewer than {count}")
    return values[:, :count]


class CompressedTensors(QuantizationMethod):
    name = "compressed-tensors"
    kinds = frozenset(
        {"weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx", "input_scale"}
    )

    def __init__(self, fmt: str, weights: dict, input_activations: dict | None):
        self.format = fmt
        self.bits = int(weights.get("num_bits", 8))
        self.type = str(weights.get("type", "int"))
        self.symmetric = bool(weights.get("symmetric", True))
        self.strategy = str(weights["strategy"])
        self.group_size = int(weights.get("group_size") or -1)
        structure = weights.get("block_structure")
        self.block: tuple[int, int] | None = (int(structure[0]), int(structure[1])) if structure else None
        self.input_activations = input_activations
        self.loads_experts = self.type == "int"  # (FP8 experts: no layout of the fused MoE's)
        stored = {"weight_packed", "weight_shape"} if fmt == "pack-quantized" else {"weight"}
        zero_point = set() if self.symmetric else {"weight_zero_point"}
        self.required = frozenset(stored | {"weight_scale"} | zero_point)

    @classmethod
    def from_config(cls, qcfg: dict) -> CompressedTensors:
        for key, what in (
            ("kv_cache_scheme", "KV-cache quantization"),
            ("sparsity_config", "sparsity (e.g. 2:4)"),
            ("transform_config", "transforms (e.g. SpinQuant / QuIP rotations)"),
        ):
            if qcfg.get(key):
                raise ValueError(f"compressed-tensors checkpoint with {what} ({key}): not supported")
        status = qcfg.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(
                f"compressed-tensors checkpoint with quantization_status {status!r}: only 'compressed' "
                "checkpoints (save_compressed=True) are supported"
            )
        schemes = []
        for group_name, group in (qcfg.get("config_groups") or {}).items():
            if group.get("weights") is None:
                raise ValueError(
                    f"compressed-tensors group {group_name!r} quantizes no weights (activations only): not supported"
                )
            if group.get("output_activations") is not None:
                raise ValueError(f"compressed-tensors group {group_name!r} quantizes output activations: not supported")
            fmt = group.get("format") or qcfg.get("format")
            schemes.append((fmt, _normalised(group["weights"]), group.get("input_activations")))
        if not schemes:
            raise ValueError("compressed-tensors checkpoint without config_groups: nothing says how it is quantized")
        fmt, weights, inputs = schemes[0]
        if any((f, w) != (fmt, weights) for f, w, _ in schemes[1:]):
            raise ValueError(
                "compressed-tensors checkpoint with several weight schemes (mixed precision): not supported; "
                "every config group must quantize weights alike"
            )
        method = cls(_supported_format(fmt, weights), weights, inputs)
        if method.input_activations is not None:
            logger.warning(
                "compressed-tensors %s: the recipe quantizes activations too (%s); Pagoda serves it weight-only, "
                "with activations in float",
                fmt,
                method._activations(),
            )
        return method

    def _activations(self) -> str:
        act = self.input_activations or {}
        kind = "INT" if act.get("type", "int") == "int" else "FP"
        dynamic = "dynamic" if act.get("dynamic") else "static"
        return f"{kind}{act.get('num_bits', 8)} {dynamic} per {act.get('strategy') or 'tensor'}"

    def describe(self) -> str:
        if self.strategy == "group":
            scales = f"groups of {self.group_size}"
        elif self.strategy == "block" and self.block is not None:
            scales = f"blocks of {self.block[0]}x{self.block[1]}"
        else:
            scales = f"per {self.strategy}"
        if self.type == "float":
            path = BLOCKS_DEQUANTIZED if self.strategy == "block" else FP8_PATH
            return f"compressed-tensors float-quantized (FP8 E4M3 weights, scales {scales}; {path})"
        zero = "symmetric" if self.symmetric else "with zero points"
        text = f"compressed-tensors {self.format} (INT{self.bits} weights, scales {scales}, {zero}"
        if self.input_activations is not None:
            act_bits = self.input_activations.get("num_bits", 8)
            text += f"; W{self.bits}A{act_bits} served weight-only: activations in float, not {self._activations()}"
        return text + ")"

    def from_checkpoint(
        self, name: str, tensors: dict[str, torch.Tensor], out_features: int, in_features: int
    ) -> QuantizedShard | Fp8Weight | torch.Tensor:
        if "weight_g_idx" in tensors:
            raise ValueError(f"{name}: activation-ordered groups (weight_g_idx) are not supported")
        if self.type == "float":
            return fp8_weight(name, tensors["weight"], tensors["weight_scale"], self.block)
        n, k = out_features, in_features
        if self.format == "pack-quantized":
            shape = tuple(int(d) for d in tensors["weight_shape"].tolist())
            if shape != (n, k):
                raise ValueError(f"{name}: weight_shape is {shape}, the model expects {(n, k)}")
            packed = tensors["weight_packed"]
            if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[0] != n:
                raise ValueError(
                    f"{name}: weight_packed is {packed.dtype} {tuple(packed.shape)}, expected int32 [{n}, *]"
                )
            q = unpack_int32(packed, self.bits, k)
        else:
            weight = tensors["weight"]
            if weight.dtype != torch.int8 or tuple(weight.shape) != (n, k):
                raise ValueError(f"{name}: weight is {weight.dtype} {tuple(weight.shape)}, expected int8 {(n, k)}")
            q = weight.to(torch.int32) + 128
        scales = self._scales(name, tensors["weight_scale"], n, k)
        mins = None
        if not self.symmetric:
            zero = self._zero_points(name, tensors["weight_zero_point"], n, scales.shape[1])
            mins = -zero.float() * scales
        group_size = self.group_size if self.strategy == "group" else -1
        return QuantizedShard(q, scales, mins, self.bits, group_size)

    def _scales(self, name: str, scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """float32 [N, G]: a per-tensor scale repeated on every row, per-channel as [N, 1]."""
        groups = -(-k // self.group_size) if self.strategy == "group" else 1
        if self.strategy == "tensor":
            if scale.numel() != 1:
                raise ValueError(f"{name}: per-tensor weight_scale has shape {tuple(scale.shape)}")
            return scale.float().reshape(1, 1).expand(n, 1).contiguous()
        if scale.numel() != n * groups:
            raise ValueError(f"{name}: weight_scale has shape {tuple(scale.shape)}, expected {(n, groups)}")
        return scale.float().reshape(n, groups)

    def _zero_points(self, name: str, zero: torch.Tensor, n: int, groups: int) -> torch.Tensor:
        """The zero points as unsigned values [N, G] (stored zero point + 2**(bits-1)), from either layout:
        packed along the rows in int32 (pack-quantized, channel and group strategies) or one signed
        value each (int-quantized, the tensor strategy, and older pack-quantized checkpoints)."""
        offset = 1 << (self.bits - 1)
        rows = 1 if self.strategy == "tensor" else n
        packed_rows = -(-rows * self.bits // 32)
        if zero.dtype == torch.int32 and zero.dim() == 2 and zero.shape[0] == packed_rows and packed_rows != rows:
            unsigned = unpack_int32(zero.t().contiguous(), self.bits, rows).t()
        elif zero.numel() == rows * groups and not zero.is_floating_point():
            unsigned = zero.to(torch.int32).reshape(rows, groups) + offset
        else:
            raise ValueError(f"{name}: weight_zero_point has shape {tuple(zero.shape)} and dtype {zero.dtype}")
        return unsigned.expand(n, groups)


def _normalised(weights: dict) -> dict:
    """The weight arguments with compressed-tensors' defaults filled in (strategy inferred from group_size)."""
    result = dict(weights)
    if not result.get("strategy"):
        group_size = result.get("group_size")
        result["strategy"] = "tensor" if group_size is None else ("channel" if group_size == -1 else "group")
    result["strategy"] = str(result["strategy"]).lower()
    result["type"] = str(result.get("type") or "int").lower()
    result["actorder"] = None if result.get("actorder") in (None, False) else str(result["actorder"]).lower()
    # Fields that change nothing in the stored tensors (how the scales were found or stored).
    for key in ("observer", "observer_kwargs", "dynamic", "scale_dtype", "zp_dtype"):
        result.pop(key, None)
    return result


def _supported_format(fmt: str | None, weights: dict) -> str:
    """`fmt`, when Pagoda reads that format with these weight arguments; else a ValueError naming what it reads."""
    bits, kind, strategy = weights.get("num_bits", 8), weights["type"], weights["strategy"]
    if fmt not in FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported; supported: {', '.join(FORMATS)}")
    if weights["actorder"] in ("group", "dynamic"):
        raise ValueError(
            f"compressed-tensors actorder {weights['actorder']!r} (activation-ordered groups with weight_g_idx) "
            "is not supported; supported: none, 'weight' / 'static' (which changes only how scales were found)"
        )
    if fmt == "float-quantized":
        if (kind, bits) != ("float", 8):
            raise ValueError(f"compressed-tensors float-quantized with {kind} {bits}-bit weights: only FP8 (float, 8)")
        if not weights.get("symmetric", True):
            raise ValueError("compressed-tensors FP8 weights with zero points (symmetric: false): only symmetric")
        if strategy not in FLOAT_STRATEGIES:
            raise ValueError(
                f"compressed-tensors FP8 weights with strategy {strategy!r}: supported: {', '.join(FLOAT_STRATEGIES)}"
            )
        return fmt
    supported_bits = (4, 8) if fmt == "pack-quantized" else (8,)
    if kind != "int" or bits not in supported_bits:
        raise ValueError(
            f"compressed-tensors {fmt} with {kind} {bits}-bit weights is not supported; supported: int "
            f"{' or '.join(map(str, supported_bits))}-bit"
        )
    if strategy not in INT_STRATEGIES:
        raise ValueError(
            f"compressed-tensors {fmt} with strategy {strategy!r} is not supported; "
            f"supported: {', '.join(INT_STRATEGIES)}"
        )
    group_size = weights.get("group_size")
    if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0 or group_size % BLOCK):
        raise ValueError(
            f"compressed-tensors group_size {group_size!r} is not supported; supported: multiples of {BLOCK}, "
            "or per-channel weights"
        )
    return fmt
