"""Turning the checkpoint tensors of each linear into its final weight while the checkpoint streams by.

Checkpoint tensors arrive one at a time, a linear's kinds (`qweight`, `scales`, `qzeros`, ...) next to
each other in practice (safetensors files list names sorted). A linear's tensors are converted as soon
as a tensor of another linear arrives, so at most one linear's checkpoint tensors are held at a time;
when a merged linear (QKV, gate+up) has all its shards, they are packed together and moved to the
device. A fused checkpoint stores a merged linear's shards in one linear's tensors (Phi-3's `qkv_proj` and
`gate_up_proj`): they are converted whole, then cut into the shards' rows. Nothing of a quantized model is
ever held in full precision beyond one linear.

FP8 linears (`Fp8Weight`) stay in FP8 where the device multiplies in FP8 (kernels/fp8.py `supported`);
elsewhere they are dequantized here to the compute dtype, and the log says which happened.

Under tensor parallel a linear's checkpoint tensors are still read whole (packed formats cannot be read
by slices), converted, and then cut to this rank's shard (`shard_for_rank`): output rows for a
column-parallel linear, input columns with their groups' scales for a row-parallel one. A mixture of
experts' experts are read whole and cut the same way (`ExpertProjection`): each expert's gate and up rows,
its down projection's columns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagoda.engine_core.layers.linear import Linear, MergedLinear
from pagoda.engine_core.quantization.base import QuantizationMethod, QuantizedShard, pack_shards, shard_columns
from pagoda.kernels import fp8
from pagoda.kernels.fp8 import Fp8Weight
from pagoda.kernels.quantized import PackedWeight

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertProjection:
    """One expert's projection of a mixture-of-experts layer as the checkpoint stores it ([n, K]), and the
    piece of it this rank holds: all of it, its output rows (tensor parallel: gate and up) or its input
    columns (the down projection). Quantized tensors cannot be read by slices, so a rank reads each whole
    and cuts what it converted (engine_core/models/moe.py `MoEMLP.checkpoint_projection`)."""

    shape: tuple[int, int]
    rows: slice | None = None
    columns: slice | None = None
    world_size: int = 1  # (named by the error when groups straddle the ranks' columns)

    def cut_weight(self, weight: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            return weight[self.rows].contiguous()
        return weight if self.columns is None else weight[:, self.columns].contiguous()

    def cut_shard(self, path: str, shard: QuantizedShard) -> QuantizedShard:
        if self.rows is not None:
            return shard.rows(self.rows)
        if self.columns is None:
            return shard
        return shard_columns(path, shard, self.columns.start, self.columns.stop, self.world_size)


class LinearAssembler:
    def __init__(self, method: QuantizationMethod, device: torch.device, fp8_matmul: bool | None = None):
        """`fp8_matmul`: keep FP8 linears in FP8 (None: where `pagoda.kernels.fp8.supported` says the device
        multiplies in FP8; True on a device that does not: dequantized per step, `--fp8-matmul on`)."""
        self.method = method
        self.device = device
        self.fp8_matmul = fp8_matmul
        self._fp8_logged = False
        self._collecting: dict[tuple[str, int | None], dict[str, torch.Tensor]] = {}
        self._shards: dict[str, dict[int, QuantizedShard | Fp8Weight]] = {}  # merged linear -> quantized shards
        self._float_shards: dict[str, set[int]] = {}  # merged linear -> shards loaded in full precision
        self._done: set[tuple[str, int | None]] = set()
        self._last: tuple[str, int | None] | None = None
        self._linears: dict[str, Linear] = {}
        self._expert_parts: dict[str, dict[str, torch.Tensor]] = {}  # an expert's tensors until all arrived
        self._experts_done: set[str] = set()  # experts converted from a quantized checkpoint's tensors

    @staticmethod
    def accepts(kind: str) -> bool:
        """Whether a linear's tensor of this kind is ours to assemble: all but its bias, a plain copy."""
        return kind != "bias"

    def add(self, path: str, linear: Linear, shard: int | None, kind: str, tensor: torch.Tensor) -> None:
        key = (path, shard)
        if key in self._done:
            raise ValueError(f"checkpoint tensor {path}.{kind} (shard {shard}) arrived after its layer was loaded")
        if self._last is not None and self._last != key:
            self._flush(self._last, final=False)
        self._last = key
        self._linears[path] = linear
        self._collecting.setdefault(key, {})[kind] = tensor

    def quantize_expert(self, path: str, tensor: torch.Tensor) -> PackedWeight:
        """One expert's projection of a mixture-of-experts layer (a checkpoint tensor [n, K] of its stacked
        experts, `path`), quantized at load as a dense linear's weight is, packed and on the device: the
        layer stacks its experts' (engine_core/models/moe.py `MoEMLP.set_quantized_shard`)."""
        shard = self.method.quantize(path, tensor) if self.method.quantizes_full_precision else None
        if not isinstance(shard, QuantizedShard):
            raise ValueError(
                f"{path}: the checkpoint stores this expert in full precision, and {self.method.describe()} does "
                "not quantize it at load; the fused MoE takes every expert of a layer in one quantized layout"
            )
        return pack_shards(path, [shard]).to(self.device)

    def expert_shard(
        self, path: str, kind: str, tensor: torch.Tensor, projection: ExpertProjection
    ) -> PackedWeight | None:
        """One expert's projection (`path` names it, `projection` says its checkpoint shape and this rank's
        piece) from one of its checkpoint tensors of `kind`, read whole: a full-precision weight is cut to
        this rank's piece and quantized at load (`quantize_expert`); a quantized checkpoint's tensors (GPTQ's
        qweight / qzeros / scales / g_idx, AWQ's, compressed-tensors', a GGUF file's blocks and type) are
        kept until all the method needs have arrived, then converted as a dense linear's are and cut (as
        `shard_for_rank` cuts a linear: output rows, or input columns with their groups' scales). The packed
        weight, on the device, once complete; else None."""
        if path in self._experts_done:
            raise ValueError(f"checkpoint tensor {path}.{kind} arrived after its expert was loaded")
        if kind == "weight" and _is_full_precision({"weight": tensor}):
            if tuple(tensor.shape) != projection.shape:
                raise ValueError(
                    f"{path}.weight: checkpoint shape {tuple(tensor.shape)}, model expects {projection.shape}"
                )
            return self.quantize_expert(path, projection.cut_weight(tensor))
        if kind not in self.method.kinds:
            raise ValueError(f"{path}: checkpoint tensor kind {kind!r} is not one of {self.method.describe()}'s")
        tensors = self._expert_parts.setdefault(path, {})
        tensors[kind] = tensor
        if not self.method.required <= tensors.keys():
            return None
        del self._expert_parts[path]
        self._experts_done.add(path)
        shard = self.method.from_checkpoint(path, tensors, *projection.shape)
        if not isinstance(shard, QuantizedShard):
            raise ValueError(
                f"{path}: {self.method.describe()} experts are not supported; the fused MoE takes integer weights"
            )
        if shard.g_idx is not None:
            # (each expert's input columns would need their own permutation: the fused MoE reads every
            # expert's columns in order, kernels/quantized.py PackedExperts)
            raise ValueError(
                f"{path}: act-order experts (desc_act, a g_idx that reorders the groups) are not supported; "
                "the fused MoE takes each expert's columns in order: quantize the experts without desc_act"
            )
        return pack_shards(path, [projection.cut_shard(path, shard)]).to(self.device)

    def finish(self, model: torch.nn.Module) -> None:
        """Convert what is still collected; every linear of `model` must now have its weight."""
        for path, tensors in self._expert_parts.items():
            raise ValueError(f"checkpoint is missing {sorted(self.method.required - tensors.keys())} of {path}")
        for key in list(self._collecting):
            self._flush(key, final=True)
        for path, module in model.named_modules():
            if isinstance(module, Linear) and module.quantized is None and not module.materialized:
                raise ValueError(f"checkpoint is missing the weights of {path}")
        for path, shards in self._shards.items():
            raise ValueError(f"{path}: only shards {sorted(shards)} of its merged projections are quantized")
        for path, floats in self._float_shards.items():
            linear = self._linears[path]
            expected = len(linear.out_sizes) if isinstance(linear, MergedLinear) else 1
            if len(floats) != expected:
                raise ValueError(f"{path}: checkpoint is missing shards {sorted(set(range(expected)) - floats)}")

    def _flush(self, key: tuple[str, int | None], final: bool) -> None:
        path, shard = key
        tensors = self._collecting.get(key)
        if tensors is None:
            return
        full_precision = _is_full_precision(tensors)
        missing = set() if full_precision else self.method.required - tensors.keys()
        if missing:
            if final:
                raise ValueError(f"checkpoint is missing {sorted(missing)} of {path} (shard {shard})")
            return  # its other tensors come later (another file)
        del self._collecting[key]
        self._done.add(key)
        linear = self._linears[path]
        # A fused checkpoint (Phi-3's qkv_proj, gate_up_proj) holds every part of a merged linear in one set
        # of tensors: converted whole, then cut into its parts' rows.
        fused = shard is None and isinstance(linear, MergedLinear)
        sizes = linear.checkpoint_out_sizes
        if full_precision:
            weight = tensors["weight"]
            if fused and weight.shape[0] != sum(sizes):
                raise ValueError(f"{path}: fused checkpoint weight has {weight.shape[0]} rows; its parts have {sizes}")
            quantize = self.method.quantizes_full_precision and linear.quantize_at_load
            result: QuantizedShard | Fp8Weight | torch.Tensor = (
                self.method.quantize(path, weight) if quantize else weight
            )
        else:
            rows = sum(sizes) if fused else sizes[0 if shard is None else shard]
            result = self.method.from_checkpoint(path, tensors, rows, linear.checkpoint_in_features)
        if not fused:
            self._place(path, linear, shard, result)
            return
        start = 0
        for part, size in enumerate(sizes):
            self._place(path, linear, part, output_rows(result, slice(start, start + size)))
            start += size

    def _place(
        self, path: str, linear: Linear, shard: int | None, result: QuantizedShard | Fp8Weight | torch.Tensor
    ) -> None:
        """Put one converted checkpoint linear (merged part `shard`, or the whole linear) into `linear`:
        this rank's piece of it, quantized or in full precision."""
        part = 0 if shard is None else shard
        result = shard_for_rank(path, linear, part, result)
        out_features = linear.out_sizes[part] if isinstance(linear, MergedLinear) else linear.out_features
        if isinstance(result, Fp8Weight) and not self._keeps_fp8(linear):
            result = result.dequantize(linear.weight.dtype)
        if isinstance(result, QuantizedShard | Fp8Weight):
            shape = tuple(result.q.shape if isinstance(result, QuantizedShard) else result.weight.shape)
            if isinstance(result, QuantizedShard) and result.input_columns is not None:
                shape = (shape[0], linear.in_features)  # whole groups, padded (QuantizedShard.columns)
            if shape != (out_features, linear.in_features):
                raise ValueError(
                    f"{path}: quantized weight is {shape}, model expects {(out_features, linear.in_features)}"
                )
            self._add_quantized(path, linear, shard, result)
        else:
            self._add_float(path, linear, shard, result)

    def _keeps_fp8(self, linear: Linear) -> bool:
        native = fp8.supported(self.device, linear.weight.dtype, linear.out_features, linear.in_features)
        if self.fp8_matmul and self.device.type == "cuda" and not native:
            raise ValueError(
                f"--fp8-matmul on: {self.device} cannot multiply this model's FP8 weights in FP8 (it needs compute "
                f"capability >= 8.9, bfloat16 and dimensions that are multiples of 16; here {linear.weight.dtype}, "
                f"{linear.out_features}x{linear.in_features}); use --fp8-matmul auto or off"
            )
        keep = native if self.fp8_matmul is None else self.fp8_matmul
        if not self._fp8_logged:
            self._fp8_logged = True
            if keep and native:
                logger.info("FP8 weights kept in FP8: torch._scaled_mm with activations quantized per token")
            elif keep:
                logger.info("FP8 weights kept in FP8 on %s (--fp8-matmul on): each dequantized per step", self.device)
            else:
                logger.info(
                    "FP8 weights dequantized at load to %s on %s, so no memory saving: FP8 matmuls need CUDA "
                    "with compute capability >= 8.9, bfloat16 and dimensions that are multiples of 16",
                    linear.weight.dtype,
                    self.device,
                )
        return keep

    def _add_quantized(self, path: str, linear: Linear, shard: int | None, result: QuantizedShard | Fp8Weight) -> None:
        if path in self._float_shards:
            raise ValueError(f"{path}: some merged projections are quantized and some are not; not supported")
        shards = self._shards.setdefault(path, {})
        shards[0 if shard is None else shard] = result
        expected = len(linear.out_sizes) if isinstance(linear, MergedLinear) else 1
        if len(shards) == expected:
            parts = [shards[i] for i in range(expected)]
            del self._shards[path]
            fp8_parts = [p for p in parts if isinstance(p, Fp8Weight)]
            int_parts = [p for p in parts if isinstance(p, QuantizedShard)]
            if fp8_parts and int_parts:
                raise ValueError(f"{path}: merged projections mix FP8 and integer quantization; not supported")
            packed = Fp8Weight.concat(fp8_parts) if fp8_parts else pack_shards(path, int_parts)
            linear.set_quantized(packed.to(self.device))

    def _add_float(self, path: str, linear: Linear, shard: int | None, weight: torch.Tensor) -> None:
        if path in self._shards:
            raise ValueError(f"{path}: some merged projections are quantized and some are not; not supported")
        linear.materialize(self.device)
        target = (
            linear.shard(shard, linear.weight)
            if isinstance(linear, MergedLinear) and shard is not None
            else linear.weight
        )
        if tuple(target.shape) != tuple(weight.shape):
            raise ValueError(
                f"{path}.weight: checkpoint shape {tuple(weight.shape)}, model expects {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(weight)
        self._float_shards.setdefault(path, set()).add(0 if shard is None else shard)


def shard_for_rank(
    path: str, linear: Linear, part: int, result: QuantizedShard | Fp8Weight | torch.Tensor
) -> QuantizedShard | Fp8Weight | torch.Tensor:
    """This rank's piece of one whole converted linear (part `part` of a merged one)."""
    if not linear.tp.parallel or linear.parallel == "replicated":
        return result
    if linear.parallel == "row":
        cols = linear.in_span
        if isinstance(result, QuantizedShard):
            return shard_columns(path, result, cols.start, cols.stop, linear.tp.world_size)
        if isinstance(result, Fp8Weight):  # one scale per output row: it stays whole
            return Fp8Weight(result.weight[:, cols.slice()].contiguous(), result.scale)
        return result[:, cols.slice()]
    return output_rows(result, linear.out_spans[part].slice())


def output_rows(
    result: QuantizedShard | Fp8Weight | torch.Tensor, rows: slice
) -> QuantizedShard | Fp8Weight | torch.Tensor:
    """Output rows `rows` of one converted linear, with their scales."""
    if isinstance(result, QuantizedShard):
        return result.rows(rows)
    if isinstance(result, Fp8Weight):
        return Fp8Weight(result.weight[rows].contiguous(), result.scale.reshape(-1)[rows])
    return result[rows]


def _is_full_precision(tensors: dict[str, torch.Tensor]) -> bool:
    """A linear stored as a plain float `weight` of 16 bits or more: a layer the checkpoint left
    unquantized. FP8 and INT8 checkpoints name their quantized tensor `weight` too, next to its scales."""
    weight = tensors.get("weight")
    return (
        tensors.keys() == {"weight"}
        and weight is not None
        and weight.is_floating_point()
        and weight.element_size() >= 2
    )
