"""A decode step's decoder layers as one C call (kernels/cpu/decoder.c): the fused CPU decode path.

`FusedDecoder` is built once from a Llama-family model's tensors (projections packed as float32 panels or
quantized, norms, KV caches, the rotary table) and then runs every layer of a batch of single-token decodes
per call. It computes what the layer-by-layer torch forward computes (the same panel and quantized matmul,
rotary, cache write and attention kernels, a quantized projection by the same path for the same row count;
RMSNorm and SiLU-and-mul in C), to float rounding.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from pagoda.kernels.cpu.arguments import as_int64, scratch_buffer
from pagoda.kernels.cpu.attention import decode_attention_threads
from pagoda.kernels.cpu.loader import load
from pagoda.kernels.cpu.quantized_matmul import mins_in_float32, row_plan, workspace_floats
from pagoda.kernels.panels import PanelWeight
from pagoda.kernels.quantized import PackedWeight

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_PROJECTIONS = ("qkv", "o", "gate_up", "down")


class _Weight(ctypes.Structure):
    _fields_ = [
        *((name, _P) for name in ("data", "scales", "mins")),
        *((name, _I64) for name in ("groups", "group", "bits", "mins_f32", "int8", "batch_from")),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("qkv", _Weight),
        ("qkv_bias", _P),
        ("o", _Weight),
        ("o_bias", _P),
        ("gate_up", _Weight),
        ("down", _Weight),
        ("key_cache", _P),
        ("value_cache", _P),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, _I64) for name in ("hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate")),
        *((name, _I64) for name in ("block_size", "window", "rot", "is_neox")),
        ("eps", _F32),
        ("scale", _F32),
        *(
            (name, _P)
            for name in (
                "cos_sin",
                "linear",
                "quantized",
                "quantized_q8",
                "attention",
                "attention_workspace",
                "rotary",
                "cache",
            )
        ),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        *((name, _I64) for name in ("batch", "max_blocks", "threads", "attention_threads", "has_residual")),
        *((name, _P) for name in ("positions", "slot_mapping", "block_tables", "seq_lens")),
        *((name, _P) for name in ("hidden", "residual", "scratch", "quantized_workspace")),
    ]


# A projection's weight: float32 panels, or quantized (8- or 4-bit, any format that loads as a PackedWeight).
Projection = PanelWeight | PackedWeight


@dataclass
class LayerTensors:
    """One decoder layer as the fused path reads it (float32, contiguous, on the CPU)."""

    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    qkv: Projection  # [(Hq + 2 Hkv) D, hidden]
    o: Projection  # [hidden, Hq D]
    gate_up: Projection  # [2 I, hidden]
    down: Projection  # [hidden, I]
    key_cache: torch.Tensor  # [blocks, block_size, Hkv, D], float32 or float16
    value_cache: torch.Tensor
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [D] (Qwen3's per-head norms: both or neither)
    k_norm: torch.Tensor | None = None


@dataclass
class Shape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    sliding_window: int | None = None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _weight(lib, w: Projection) -> _Weight:
    if isinstance(w, PanelWeight):
        return _Weight(data=w.data.data_ptr())
    plan = row_plan(lib, w)
    return _Weight(
        data=w.data.data_ptr(),
        scales=w.scales.data_ptr(),
        mins=_ptr(w.mins),
        groups=w.num_groups,
        group=w.group_size,
        bits=w.bits,
        mins_f32=mins_in_float32(w),
        int8=int(plan.int8),
        batch_from=plan.batch_from,
    )


def _address(lib, name: str) -> int | None:
    return ctypes.cast(lib[name], ctypes.c_void_p).value


class FusedDecoder:
    def __init__(self, shape: Shape, layers: list[LayerTensors], cos_sin_cache: torch.Tensor, is_neox: bool = True):
        lib = load()
        if lib is None:
            raise RuntimeError("the CPU kernels are not available")
        self._lib = lib
        self._check(shape, layers, cos_sin_cache)
        half = layers[0].key_cache.dtype == torch.float16  # (--kv-cache-dtype float16)
        attention, cache = (
            ("paged_decode_attention_f16kv", "reshape_and_cache_f16kv")
            if half
            else ("paged_decode_attention_f32", "reshape_and_cache_f32")
        )
        if attention not in lib or cache not in lib:
            raise ValueError("this CPU or compiler has no float16 KV cache kernels (F16C, _Float16)")
        self._keep = (layers, cos_sin_cache)  # (the C side holds raw pointers into these)
        self.shape = shape
        self._model = _Model(
            hidden=shape.hidden,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            intermediate=shape.intermediate,
            block_size=layers[0].key_cache.shape[1],
            window=shape.sliding_window or 0,
            rot=cos_sin_cache.shape[1],
            is_neox=int(is_neox),
            eps=shape.eps,
            scale=shape.head_dim**-0.5,
            cos_sin=cos_sin_cache.data_ptr(),
            linear=_address(lib, "panel_linear_f32"),
            quantized=_address(lib, "quantized_linear_f32"),
            quantized_q8=_address(lib, "quantized_linear_q8_f32") if "quantized_linear_q8_f32" in lib else None,
            attention=_address(lib, attention),
            attention_workspace=_address(lib, "paged_decode_attention_workspace"),
            rotary=_address(lib, "rotary_embedding_f32"),
            cache=_address(lib, cache),
        )
        self._layers = (_Layer * len(layers))(  # (the struct's fields are LayerTensors' names)
            *(
                _Layer(
                    **{
                        name: _weight(lib, getattr(t, name)) if name in _PROJECTIONS else _ptr(getattr(t, name))
                        for name in (field[0] for field in _Layer._fields_)
                    }
                )
                for t in layers
            )
        )
        self.num_layers = len(layers)
        # Every distinct quantized layout with the plan its projections were given (the settings of now: the
        # C side follows those plans, so the workspace must too), for the workspace a batch needs.
        layouts = {
            (w.bits, w.in_features, w.group_size, w.num_groups): w
            for t in layers
            for w in (t.qkv, t.o, t.gate_up, t.down)
            if isinstance(w, PackedWeight)
        }
        self._quantized = [(w, row_plan(lib, w)) for w in layouts.values()]
        self._workspace_floats: dict[tuple[int, int], int] = {}  # (batch, threads) -> floats
        self._quantized_workspace = torch.empty(0)
        # From this batch on, a quantized projection takes a path the C decoder does not have (oneDNN tiles,
        # prefill sizes): such steps run layer by layer.
        self.max_batch = min((plan.tiles_from - 1 for _, plan in self._quantized), default=None)

    @staticmethod
    def _check(shape: Shape, layers: list[LayerTensors], cos_sin: torch.Tensor) -> None:
        """The C code reads raw pointers: refuse anything but the exact layouts it assumes."""
        h, d, i = shape.hidden, shape.head_dim, shape.intermediate
        q, kv = shape.num_heads * d, shape.num_kv_heads * d
        if not layers:
            raise ValueError("no layers")

        def plain(t: torch.Tensor | None, *size: int, dtype: torch.dtype = torch.float32) -> bool:
            return t is None or (
                t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous() and tuple(t.shape) == size
            )

        def panels(p: Projection, n: int, k: int) -> bool:
            if isinstance(p, PackedWeight):
                return quantized(p, n, k)
            return (
                p.out_features == n and p.in_features == k and p.data.is_contiguous() and p.data.dtype == torch.float32
            )

        def quantized(p: PackedWeight, n: int, k: int) -> bool:
            """The quantized kernels' layout (quantized_matmul.py `mins_in_float32` checks the rest); the rows
            they read are the decoder's buffers' rows, so no input padding or reordering."""
            mins_in_float32(p)
            return (
                p.out_features == n
                and p.in_features == k
                and p.padded_in_features == k
                and p.perm is None
                and p.data.is_contiguous()
                and p.data.device.type == "cpu"
            )

        cache_shape, cache_dtype = tuple(layers[0].key_cache.shape), layers[0].key_cache.dtype
        if cache_dtype not in (torch.float32, torch.float16) or (cache_dtype == torch.float16 and d % 8):
            raise ValueError(f"a {cache_dtype} KV cache (head size {d}) is not the fused decode path's")
        for n, t in enumerate(layers):
            ok = (
                plain(t.input_norm, h)
                and plain(t.post_norm, h)
                and plain(t.q_norm, d)
                and plain(t.k_norm, d)
                and (t.q_norm is None) == (t.k_norm is None)
                and panels(t.qkv, q + 2 * kv, h)
                and panels(t.o, h, q)
                and panels(t.gate_up, 2 * i, h)
                and panels(t.down, h, i)
                and plain(t.qkv_bias, q + 2 * kv)
                and plain(t.o_bias, h)
                and len(cache_shape) == 4
                and cache_shape[2:] == (shape.num_kv_heads, d)
                and plain(t.key_cache, *cache_shape, dtype=cache_dtype)
                and plain(t.value_cache, *cache_shape, dtype=cache_dtype)
            )
            if not ok:
                raise ValueError(f"layer {n}: a tensor's shape, dtype or layout is not the fused decode path's")
        if not plain(cos_sin, *cos_sin.shape) or cos_sin.dim() != 2 or cos_sin.shape[1] > d:
            raise ValueError("the rotary table must be float32 [positions, rot <= head_dim]")

    def __call__(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over `hidden` [B, hidden] (B single-token decodes; `residual` None before the first
        layer) -> (hidden, residual) after the last. The inputs are not modified."""
        batch = hidden.shape[0]
        if hidden.shape != (batch, self.shape.hidden) or hidden.dtype != torch.float32:
            raise ValueError(
                f"hidden states {tuple(hidden.shape)} {hidden.dtype}: want [batch, {self.shape.hidden}] float32"
            )
        positions, slot_mapping, block_tables, seq_lens = (
            as_int64(t) for t in (positions, slot_mapping, block_tables, seq_lens)
        )
        if not (positions.numel() == slot_mapping.numel() == seq_lens.numel() == block_tables.shape[0] == batch):
            raise ValueError("positions, slots, block tables and lengths must have one entry per sequence")
        out = hidden.clone(memory_format=torch.contiguous_format)
        stream = torch.empty_like(out) if residual is None else residual.clone(memory_format=torch.contiguous_format)
        threads = torch.get_num_threads()
        attention_threads = decode_attention_threads(batch, max_seq_len)
        max_blocks = block_tables.shape[1]
        scratch_size = cast(Callable[..., int], self._lib["decoder_scratch_floats"])  # (restype int64)
        scratch = scratch_buffer(scratch_size(ctypes.byref(self._model), batch, max_blocks, attention_threads))
        quantized_workspace = None
        if self._quantized:  # (its own buffer: scratch_buffer's one is the scratch above)
            floats = self._workspace_floats.get((batch, threads))
            if floats is None:
                floats = max(
                    workspace_floats(self._lib, plan.path(batch), batch, w, threads) for w, plan in self._quantized
                )
                self._workspace_floats[(batch, threads)] = floats
            if self._quantized_workspace.numel() < floats:
                self._quantized_workspace = torch.empty(floats, dtype=torch.float32)
            quantized_workspace = self._quantized_workspace
        step = _Step(
            batch=batch,
            max_blocks=max_blocks,
            threads=threads,
            attention_threads=attention_threads,
            has_residual=int(residual is not None),
            positions=positions.data_ptr(),
            slot_mapping=slot_mapping.data_ptr(),
            block_tables=block_tables.data_ptr(),
            seq_lens=seq_lens.data_ptr(),
            hidden=out.data_ptr(),
            residual=stream.data_ptr(),
            scratch=scratch.data_ptr(),
            quantized_workspace=_ptr(quantized_workspace),
        )
        if batch:
            self._lib["decode_layers_f32"](ctypes.byref(self._model), self._layers, self.num_layers, ctypes.byref(step))
        return out, stream
