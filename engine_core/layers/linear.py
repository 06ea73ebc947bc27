"""Linear layers whose weight memory layout is chosen for the CPU's matrix-vector speed.

The weight is always exposed as `[out_features, in_features]` (what checkpoints hold and F.linear
takes), but on the CPU its storage is `[in, out]` when the output is at least as wide as the input:
MKL streams such weights up to 1.9x faster for a single decode token (576->3072: 21.5 vs 11.4 GB/s
here), while narrowing projections (1536->576) are faster in the usual layout. Large batches run at the
same speed either way. Merged layers (QKV, gate+up) make one matmul out of several small ones.

After loading, `pack_for_cpu` repacks float32 CPU weights once, valid for any batch size, and releases
the plain weight:
- into panels of 16 output columns (kernels/panels.py) for the compiled C matmul: against oneDNN's
  packed matmul in one run, 1.36x as fast at one row, 1.02-1.20x at 4-64, level at prefill sizes
  (docs/decode-speed.md). A tied LM head's embedding rows are read from its panels;
- into oneDNN's blocked layout where the C kernels are off or PAGODA_DISABLE_PANEL_LINEAR=1, and for a
  linear with a fused activation
  (oneDNN applies it as it writes the output): 1.3x faster than MKL on the plain weight at one token
  and up to 2.7x at 16. A tied LM head then keeps its plain weight too, for the embedding lookup.

A quantized linear holds a `PackedWeight` (kernels/quantized.py: integer weights with group scales) or an
`Fp8Weight` (kernels/fp8.py; FP8 on CUDA) instead (see engine_core/quantization). While a
quantized model is built (`deferred_weights()`), weights are not allocated: the loader either fills a
linear's packed weight or, for a layer the checkpoint keeps in full precision, allocates its weight
when the first tensor for it arrives (`materialize`).

Tensor parallel: a linear's `parallel` style says how it is split over the group it is built in
(engine_core/parallel/distributed.py `building_for`); model files name the style, the layer does the rest:
- "replicated": every rank holds the whole weight (the only style at world size 1);
- "column": each rank holds a slice of the output rows (of each merged part; `heads` makes the slices
  whole attention heads, see engine_core/parallel/sharding.py), so its output is a slice of the full
  output;
- "row": each rank holds a slice of the input columns and computes a partial sum of the full output;
  one all-reduce adds the partial sums, then the bias is added (once); with `reduce=False` the caller
  adds them (a mixture of experts: its shared expert's sum and the experts' in one all-reduce);
- "vocab": the LM head's rows split by vocabulary (the model gathers the logits).
`in_features` / `out_features` / `out_sizes` are this rank's; `in_span` / `out_spans` place them in the
checkpoint's tensors, which the loader slices accordingly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.engine_core.environment import onednn_linear_disabled, panel_linear_disabled
from pagoda.engine_core.parallel.distributed import TPGroup, building_group
from pagoda.engine_core.parallel.sharding import AttentionHeads, Span, split_rows, split_vocab
from pagoda.kernels import ops
from pagoda.kernels.fp8 import Fp8Weight
from pagoda.kernels.panels import PanelWeight
from pagoda.kernels.quantized import PackedWeight

_deferred = False  # inside deferred_weights(): linears are built without weight storage


@contextlib.contextmanager
def deferred_weights() -> Iterator[None]:
    """Build linears without allocating their weights (a quantized checkpoint replaces most of them)."""
    global _deferred
    _deferred, previous = True, _deferred
    try:
        yield
    finally:
        _deferred = previous


def weights_deferred() -> bool:
    """Whether layers are being built inside `deferred_weights()` (a quantized model: the loader fills them)."""
    return _deferred


def _weight(in_features: int, out_features: int, dtype, device=None) -> torch.Tensor:
    if _deferred and device is None:
        return torch.empty(out_features, in_features, dtype=dtype, device="meta")
    if device is None:
        device = torch.empty(0).device  # respects an enclosing `with torch.device(...)`
    if torch.device(device).type == "cpu" and out_features >= in_features:
        return torch.empty(in_features, out_features, dtype=dtype, device=device).t()
    return torch.empty(out_features, in_features, dtype=dtype, device=device)


def _onednn_usable() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and not onednn_linear_disabled()
    )


def onednn_rows(count: int) -> int:
    """The row count a packed matmul runs at: `count` rounded up to one of ~40 sizes.

    oneDNN builds (and caches, up to 1,024 entries) a primitive per input shape, and each one holds
    megabytes of its own: with every step's token count a new shape, a server's memory grew by hundreds
    of MiB over a few thousand requests. Few sizes bound that cache. Small batches (decode) stay exact
    up to 16 rows, then round to 8 (weight-bandwidth-bound: extra rows are nearly free), large ones
    to 64 (at most a few % more compute where it matters)."""
    if count <= 16:
        return count
    if count <= 128:
        return -(-count // 8) * 8
    return -(-count // 64) * 64


PARALLEL_STYLES = ("replicated", "column", "row", "vocab")
# An activation a linear may apply to its output: (torch function, oneDNN post-op, its algorithm). The
# packed CPU matmul applies it as it writes the output (BERT's GELU: one pass over the widest activations
# saved, about 2x faster than a separate GELU here); every other path applies the torch function after.
ACTIVATIONS = {
    "gelu": (F.gelu, "gelu", "none"),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), "gelu", "tanh"),
    "relu": (F.relu, "relu", ""),
}


def _spans(
    parallel: str, in_features: int, out_sizes: list[int], heads: AttentionHeads | None, group: TPGroup
) -> tuple[Span, list[Span]]:
    """(input span, output span of each part) this rank holds, in checkpoint coordinates."""
    if parallel not in PARALLEL_STYLES:
        raise ValueError(f"unknown parallel style {parallel!r}; one of {', '.join(PARALLEL_STYLES)}")
    whole_in, whole_out = Span(0, in_features), [Span(0, size) for size in out_sizes]
    if not group.parallel or parallel == "replicated":
        return whole_in, whole_out
    rank, world = group.rank, group.world_size
    if parallel == "vocab":
        return whole_in, [split_vocab(out_sizes[0], rank, world)]
    if heads is None:
        if parallel == "row":
            return split_rows(in_features, rank, world), whole_out
        return whole_in, [split_rows(size, rank, world) for size in out_sizes]
    q_heads, kv_heads = heads.of_rank(rank, world)
    if parallel == "row":  # (the output projection: its inputs are the query heads)
        return q_heads.scaled(in_features // heads.num_heads), whole_out
    # (column-parallel with heads: the merged Q, K, V projection, or its first parts: Q and K where the
    # values are the keys, Gemma 4's `attention_k_eq_v`; Q alone in a layer that reads another's K/V. A
    # query head's rows may be wider than a K/V head's: Qwen3.5's hold its output gate too.)
    q_size = out_sizes[0] // heads.num_heads
    kv_size = out_sizes[1] // heads.num_kv_heads if len(out_sizes) > 1 else 0
    parts = [q_heads.scaled(q_size), kv_heads.scaled(kv_size), kv_heads.scaled(kv_size)]
    return whole_in, parts[: len(out_sizes)]


class Linear(nn.Module):
    activation: str | None = None  # (set by __init__; a MergedLinear has none)
    # Whether quantization at load (`--quantization int8|int4|fp8`) quantizes this linear; a model sets it False
    # on a small linear whose outputs decide more than their size (an MoE router), which then stays in full
    # precision.
    quantize_at_load = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype=None,
        parallel: str = "replicated",
        heads: AttentionHeads | None = None,
        activation: str | None = None,
        reduce: bool = True,
    ):
        """`heads`: a row-parallel linear's inputs are the attention's query heads, split whole with
        their K/V heads (the output projection). `activation`: one of ACTIVATIONS, applied to the output
        (not under tensor parallel's row split, whose partial sums are added after the matmul).
        `reduce=False`: a row-parallel linear returns this rank's partial sum, which the caller adds to
        others before one all-reduce of its own (a mixture of experts' shared expert); no bias then."""
        self._init(in_features, [out_features], bias, dtype, parallel, heads)
        if not reduce:
            if bias:
                raise ValueError("a row-parallel linear without its all-reduce takes no bias (each rank would add it)")
            self.reduces = False
        if activation is not None and (activation not in ACTIVATIONS or self.reduces):
            raise ValueError(f"activation {activation!r}: one of {', '.join(ACTIVATIONS)}, on an unreduced linear")
        self.activation = activation

    def _init(
        self, in_features: int, out_sizes: list[int], bias: bool, dtype, parallel: str, heads: AttentionHeads | None
    ) -> None:
        super().__init__()
        self.tp = building_group()
        self.parallel = parallel
        self.checkpoint_in_features, self.checkpoint_out_sizes = in_features, out_sizes
        self.in_span, self.out_spans = _spans(parallel, in_features, out_sizes, heads, self.tp)
        in_features, out_features = self.in_span.size, sum(span.size for span in self.out_spans)
        self.reduces = parallel == "row" and self.tp.parallel  # one all-reduce after the matmul
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(_weight(in_features, out_features, dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.panels: PanelWeight | None = None  # the weight in the C matmul's panels, once packed
        self.packed: torch.Tensor | None = None  # oneDNN's layout of the weight, once packed
        self.quantized: PackedWeight | Fp8Weight | None = None  # the quantized weight, which replaces `weight`
        self._quantized_linear = ops.quantized_linear  # the kernel op for `quantized`'s type

    @property
    def materialized(self) -> bool:
        return not self.weight.is_meta

    def materialize(self, device: torch.device) -> None:
        """Allocate the full-precision weight of a linear built under `deferred_weights()`."""
        if self.weight.is_meta:
            weight = _weight(self.in_features, self.out_features, self.weight.dtype, device)
            self.weight = nn.Parameter(weight, requires_grad=False)

    def set_quantized(self, packed: PackedWeight | Fp8Weight) -> None:
        """From now on compute with `packed`; the full-precision weight is released."""
        # The input columns it reads: with a `perm`, those it selects (an act-order weight split by input
        # columns stores whole groups, padded: engine_core/quantization/base.py `shard_columns`).
        perm = getattr(packed, "perm", None)
        in_features = packed.in_features if perm is None else int(perm.max()) + 1
        if (packed.out_features, in_features) != (self.out_features, self.in_features):
            raise ValueError(
                f"quantized weight is {packed.out_features}x{packed.in_features}, "
                f"the layer is {self.out_features}x{self.in_features}"
            )
        self.quantized = packed
        self._quantized_linear = ops.fp8_linear if isinstance(packed, Fp8Weight) else ops.quantized_linear
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype, device="meta"), requires_grad=False)

    def weight_bytes(self) -> int:
        """Bytes this layer's weight (packed, quantized or plain) and bias hold in memory."""
        total = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        if self.quantized is not None:
            return total + self.quantized.nbytes()
        if self.panels is not None:
            total += self.panels.nbytes()
        if self.packed is not None:
            total += self.packed.numel() * self.packed.element_size()
        if not self.weight.is_meta:
            total += self.weight.numel() * self.weight.element_size()
        return total

    def pack_for_cpu(self, tied_embedding: bool = False) -> bool:
        """Use the panels or oneDNN's packed layout from now on (float32 on the CPU; bfloat16 in oneDNN's,
        where the CPU has bfloat16 instructions); True if packed. `tied_embedding`: the weight is also the
        embedding table (a tied LM head)."""
        weight = self.weight
        if self.quantized is not None or weight.device.type != "cpu":
            return False
        if weight.dtype == torch.bfloat16:
            # oneDNN's packed bfloat16 matmul reads the weights 2.3x as fast as F.linear's at one row (a
            # 4096 x 12288 matrix: 37.8 against 16.1 GB/s, 2-core AMD EPYC with AVX-512 BF16); the panels are
            # float32 only. Without the CPU's bfloat16 instructions oneDNN would emulate them: F.linear then.
            if not (_onednn_usable() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
                return False
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 16)
            if tied_embedding:
                return True
        elif weight.dtype != torch.float32:
            return False
        elif self.activation is None and ops.compiled("panel_linear", weight.device) and not panel_linear_disabled():
            self.panels = PanelWeight.pack(weight)  # (the embedding lookup reads its rows: no plain copy)
        elif _onednn_usable():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 16)
            if tied_embedding:  # oneDNN's layout cannot be read by row: keep the plain weight too
                return True
        else:
            return False
        self.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
        return True

    def checkpoint_slices(self, part: int | None, kind: str) -> tuple[slice, ...] | None:
        """The slice this rank holds of a checkpoint's full-precision `weight` [out, in] or `bias` [out]
        (of merged part `part`); None: all of it."""
        if not self.tp.parallel or self.parallel == "replicated":
            return None
        if self.parallel == "row":  # the bias is whole: it is added once, after the all-reduce
            return (slice(None), self.in_span.slice()) if kind == "weight" else None
        return (self.out_spans[part or 0].slice(),)

    def forward(self, x: torch.Tensor, bulk_rows_from: int | None = None) -> torch.Tensor:
        """`bulk_rows_from`: x's rows from this one on are a step's bulk rows (long prompts'), which the
        float32 panel matmul may compute on Intel's AMX (ops.panel_linear)."""
        if self.activation is not None:
            function, post_op, algorithm = ACTIVATIONS[self.activation]
            if self.packed is not None:
                return self._packed_matmul(x, self.bias, post_op, algorithm)
            return function(self._matmul(x, self.bias, bulk_rows_from))
        if not self.reduces:
            return self._matmul(x, self.bias, bulk_rows_from)
        out = self.tp.all_reduce(self._matmul(x, None, bulk_rows_from))
        if self.bias is not None:
            out += self.bias
        return out

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None, bulk_rows_from: int | None = None) -> torch.Tensor:
        if self.quantized is not None:
            return self._quantized_linear(x, self.quantized, bias)
        if self.panels is not None:
            return ops.panel_linear(x, self.panels, bias, bulk_rows_from)
        if self.packed is not None:
            return self._packed_matmul(x, bias, "none", "")
        return F.linear(x, self.weight, bias)

    def _packed_matmul(self, x: torch.Tensor, bias: torch.Tensor | None, post_op: str, algorithm: str) -> torch.Tensor:
        if x.dim() == 2 and onednn_rows(x.shape[0]) == x.shape[0]:  # (the model's calls: no reshapes, no slice)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, post_op, [], algorithm)
        rows = x.reshape(-1, x.shape[-1])
        count = rows.shape[0]
        padded = onednn_rows(count)
        if padded != count:
            rows = F.pad(rows, (0, 0, 0, padded - count))
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, bias, post_op, [], algorithm)
        return out[:count].reshape(*x.shape[:-1], out.shape[-1])


class MergedLinear(Linear):
    """Several linears sharing an input, computed as one matmul; outputs are the column slices."""

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        bias: bool = False,
        dtype=None,
        parallel: str = "replicated",
        heads: AttentionHeads | None = None,
    ):
        """`out_sizes` are the checkpoint's; under tensor parallel each part is split ("column"). `heads`:
        the parts are the attention's Q, K and V projections, split by whole heads."""
        self._init(in_features, out_sizes, bias, dtype, parallel, heads)
        self.out_sizes = [span.size for span in self.out_spans]  # this rank's
        self.offsets = [sum(self.out_sizes[:i]) for i in range(len(self.out_sizes))]

    def shard(self, index: int, param: torch.Tensor) -> torch.Tensor:
        """The rows of `param` (weight or bias) that belong to the `index`-th merged linear."""
        return param[self.offsets[index] : self.offsets[index] + self.out_sizes[index]]

    def checkpoint_slices(self, part: int | None, kind: str) -> tuple[slice, ...] | None:
        """As `Linear.checkpoint_slices` for part `part`'s checkpoint tensor. `part` None: a fused tensor
        holding every part (`checkpoint_parts`), read whole, since this rank's rows of it are not one slice."""
        return None if part is None else super().checkpoint_slices(part, kind)

    def checkpoint_parts(self, tensor: torch.Tensor, kind: str) -> list[torch.Tensor]:
        """A fused checkpoint tensor, every part's rows stacked in one `weight` or `bias` (Phi-3 stores its
        qkv_proj and gate_up_proj so), cut into the parts, each to the rows this rank holds."""
        if tensor.shape[0] != sum(self.checkpoint_out_sizes):
            raise ValueError(
                f"fused checkpoint {kind} has {tensor.shape[0]} rows; its parts have {self.checkpoint_out_sizes}"
            )
        parts = tensor.split(self.checkpoint_out_sizes)
        return [
            part if (rows := self.checkpoint_slices(index, kind)) is None else part[rows]
            for index, part in enumerate(parts)
        ]
