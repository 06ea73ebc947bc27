"""Filling a model's parameters from checkpoint tensors as they stream by: shared by every model class.

A merged linear (QKV, gate+up) is filled from one checkpoint tensor per part (q_proj, k_proj, v_proj), or
from one fused tensor that holds every part's rows, which a checkpoint names by the merged linear itself
(Phi-3's `qkv_proj` and `gate_up_proj`): that is read whole and cut into the parts, each to this rank's rows
(`MergedLinear.checkpoint_parts`; quantized, by the assembler after conversion)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, cast

import torch
from torch import nn

from pagoda.engine_core.layers.linear import Linear, MergedLinear
from pagoda.engine_core.quantization.assembly import ExpertProjection, LinearAssembler
from pagoda.kernels.quantized import PackedWeight


class ShardedParameters(Protocol):
    """A module whose parameters are filled from several checkpoint tensors each (MergedLinear's merged
    rows; an MoE MLP's stacked experts): `_target` names the shard, `shard` gives its view to copy into.
    Stacked experts built deferred (quantized at load) take each shard quantized instead
    (`set_quantized_shard`, engine_core/models/moe.py)."""

    def shard_count(self, param: torch.Tensor) -> int: ...

    def shard(self, index: int, param: torch.Tensor) -> torch.Tensor: ...


class QuantizedShards(Protocol):
    """Stacked parameters that, built deferred, take each checkpoint shard quantized and packed; the
    assembler reads each shard whole and cuts it to this rank's piece (`checkpoint_projection`)."""

    def checkpoint_projection(self, param: torch.Tensor) -> ExpertProjection: ...

    def set_quantized_shard(self, index: int, param: torch.Tensor, packed: PackedWeight) -> None: ...


def _shard_indices(module: object, param: torch.Tensor) -> list[int | None]:
    if isinstance(module, MergedLinear):
        return list(range(len(module.out_sizes)))
    if hasattr(module, "shard_count"):
        return list(range(cast(ShardedParameters, module).shard_count(param)))
    return [None]


class CheckpointLoading:
    """Mixed into an nn.Module model that names, in `_target`, its parameter (and merged shard index) for a
    checkpoint tensor name, or None to skip the tensor."""

    def _target(self, name: str) -> tuple[str, int | None] | None:
        raise NotImplementedError

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], assembler: LinearAssembler | None = None
    ) -> None:
        """Consume (checkpoint name, tensor) pairs; every parameter must be filled. With an `assembler`
        (a quantized model), each linear's tensors but its bias go to it instead."""
        model = cast(nn.Module, self)
        pending: set[tuple[str, int | None]] = set()  # (parameter, merged shard or None) still to fill
        for name, parameter in model.named_parameters():
            module = model.get_submodule(name.rpartition(".")[0]) if "." in name else None
            if assembler is not None and isinstance(module, Linear) and name.endswith(".weight"):
                continue  # the assembler checks these
            pending.update((name, shard) for shard in _shard_indices(module, parameter))
        for name, tensor in weights:
            target = self._target(name)
            if target is None:
                continue
            param_name, shard = target
            module_path, _, kind = param_name.rpartition(".")
            if assembler is not None and assembler.accepts(kind):
                try:
                    linear = model.get_submodule(module_path)
                except AttributeError:
                    linear = None
                if isinstance(linear, Linear):
                    assembler.add(module_path, linear, shard, kind, tensor)
                    continue
            try:
                param: torch.Tensor = model.get_parameter(param_name)  # or a merged shard of it, below
            except AttributeError:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}") from None
            merged = model.get_submodule(module_path) if shard is None and module_path else None
            if isinstance(merged, MergedLinear):  # a fused tensor: every part of the merged linear in one
                for index, part in enumerate(merged.checkpoint_parts(tensor, kind)):
                    _copy(name, merged.shard(index, param), part)
                    pending.discard((param_name, index))
                continue
            stacked, owner = param, None
            if shard is not None:  # (see _target)
                owner = cast(ShardedParameters, model.get_submodule(param_name.rpartition(".")[0]))
                param = owner.shard(shard, param)
            if assembler is not None and shard is not None and param.is_meta and hasattr(owner, "set_quantized_shard"):
                # (stacked experts built deferred: each expert's projection, read whole, quantized at load as it
                # arrives, or converted from a quantized checkpoint's tensors once they all have; then cut to
                # this rank's piece)
                experts = cast(QuantizedShards, owner)
                projection_name, _, kind = name.rpartition(".")  # (the checkpoint's name names it in errors)
                projection = experts.checkpoint_projection(stacked)
                packed = assembler.expert_shard(projection_name, kind, tensor, projection)
                if packed is None:
                    continue
                experts.set_quantized_shard(shard, stacked, packed)
            else:
                _copy(name, param, tensor)
            pending.discard((param_name, shard))
        if assembler is not None:
            assembler.finish(model)
        if pending:
            raise ValueError(f"checkpoint is missing weights: {sorted(n for n, _ in pending)[:8]}")


def _copy(name: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}")
    param.copy_(tensor)
