"""OpenAI's gpt-oss (`GptOssForCausalLM`): the Llama family's layers with

- attention sinks: a learned logit per head that joins each softmax's denominator (`Attention.sinks`,
  passed to the attention ops);
- attention alternating per layer between a sliding window (128 tokens in the released models) and
  full attention, as the config's `layer_types` say;
- YaRN rotary scaling (engine_core/layers/rotary.py), biases on q/k/v/o;
- every layer's MLP a mixture of experts (`GptOssMLP`): a router with a bias whose top-k logits are
  softmaxed over those k, experts with biases and a clamped SwiGLU (`ClampedSwiGLU`), all through
  `ops.fused_moe`'s keyword options (on the CPU computed by its C kernel, kernels/cpu/moe.c).

Checkpoints store a layer's experts as stacked tensors: `mlp.experts.gate_up_proj` [E, H, 2I] with gate
and up interleaved along the last axis (gate the even columns), `down_proj` [E, I, H], and their biases;
they are transposed and de-interleaved at load into our `w13` [E, 2I, H] (gate rows, then up rows: each half
filled from its own view) and `w2` [E, H, I]. MXFP4 checkpoints (`quantization_config.quant_method: mxfp4`,
the released models) store those two as `*_blocks` / `*_scales`, which stay 4-bit (kernels/mxfp4.py); only
their rows are reordered. On the CPU the fused MoE's C kernel reads those blocks as they are, expanding each
in registers; float32 experts are packed after load into the panels it reads (`GptOssMLP.pack_for_cpu`, as
models/moe.py's `MoEMLP` packs its own).

GGUF files (llama.cpp's "gpt-oss", engine_core/gguf_gpt_oss.py) hold each projection stacked apart, rows
first; they arrive as `mlp.experts.{gate,up,down}_proj.{weight,bias,blocks,scales}` (or gate and up joined as
`gate_up_proj.*`, gate rows first), MXFP4 blocks already in the layout above, and load as they are.

Tensor parallel (engine_core/parallel) splits attention by heads as the Llama family does, each rank's
sinks those of its query heads; the output projection's bias is added once, after its all-reduce. The
router (with its bias) is replicated. By default every rank holds every expert's slice of the intermediate
rows: the gate and up rows with their biases, the down projection's columns. MXFP4 experts split in whole
blocks of 32 rows (parallel/sharding.py `expert_row_unit`), since the down projection stores its columns
in those blocks; float experts split row by row. The down projection's bias is added on rank 0 only, so
the ranks' partial sums, each weighted per token and expert by the routing, add up to the whole layer's
output. With expert parallel (`--enable-expert-parallel`) each rank holds a contiguous range of whole
experts, biases included, routes every token over all experts and computes only its experts' pairs
(`Routing.expert_offset` / `local_experts`). Either way one all-reduce per layer adds the partial sums.
Each rank reads only its slice of the stacked checkpoint tensors (`checkpoint_slices`: in a Hugging Face
checkpoint's interleaved layout rank rows [a, b) are gate/up columns [2a, 2b), split after; a GGUF file's
are rows first).
Pipeline parallel holds whole layers per stage, each keeping its sliding window or full attention by its
global index.

Refused with an error naming the limit: MXFP4 experts split over more ranks than their intermediate size
has blocks of 32 (here and in parallel/sharding.py), a GGUF file's joined gate_up experts under tensor
parallel without expert parallel (its halves cannot be cut as one slice), quantizing at load and other
quantized formats (loader.py; a GGUF file's quantized tensors other than MXFP4 experts are dequantized when
read, engine_core/gguf_gpt_oss.py). The fused CPU decode step declines the sinks layers
(fused_decode.py); CUDA graphs are not captured (its experts run the torch reference, which reads the
routing on the host: cuda_graphs.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import cast

import torch
from torch import nn

from pagoda.engine_core.layers.linear import Linear, weights_deferred
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models.llama import LlamaForCausalLM
from pagoda.engine_core.models.llama_layers import LlamaDecoderLayer
from pagoda.engine_core.models.moe import experts_of, pack_experts_for_cpu, place_experts
from pagoda.engine_core.parallel.distributed import building_expert_parallel, building_group, building_stage
from pagoda.engine_core.parallel.sharding import (
    MXFP4_BLOCK,
    Span,
    check_model_splits,
)
from pagoda.engine_core.quantization import checkpoint_method_name
from pagoda.engine_core.quantization.assembly import LinearAssembler
from pagoda.kernels import ops
from pagoda.kernels.mxfp4 import Mxfp4Experts
from pagoda.kernels.panels import ExpertPanels
from pagoda.kernels.torch_ref.moe import ClampedSwiGLU, ExpertWeights, Routing

# A Hugging Face checkpoint's expert tensor: layer, projection, suffix ("" for the weight, _bias, _blocks,
# _scales). Float weights are [E, in, out]; gate_up_proj's rows (columns of the float weight) interleave gate
# and up.
_HF_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_HF_KINDS = {"": "weight", "_bias": "bias", "_blocks": "blocks", "_scales": "scales"}
# A stacked projection named as a module, rows first ([E, out, in]): how GGUF files' experts arrive, and
# HF's once `_in_our_layout` has turned them. gate_up_proj here is gate rows, then up rows.
_STACKED = re.compile(
    r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)\.(weight|bias|blocks|scales)$"
)
# projection -> (our parameter, its checkpoint shard: gate and up each fill half of w13's rows)
_OURS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
_OUR_KINDS = {"weight": "", "bias": "_bias", "blocks": ".blocks", "scales": ".scales"}


def uses_mxfp4(cfg: ModelConfig) -> bool:
    """Whether the checkpoint stores its experts MXFP4 (its config's quantization_config says so)."""
    return checkpoint_method_name(cfg.raw) == "mxfp4"


class GptOssMLP(nn.Module):
    """A layer's mixture of experts: `router` (a Linear with bias, [E, H]), each expert's gate/up
    projection `w13` [E, 2I, H] and down projection `w2` [E, H, I] (tensors, or `Mxfp4Experts`), and
    their biases `w13_bias` [E, 2I], `w2_bias` [E, H]. Float32 CPU experts are packed after load into
    `packed13` / `packed2` (`pack_for_cpu`), which replace w13 / w2.

    Under tensor parallel E and I are this rank's: `expert_span` (expert parallel) or `inter_span`
    (otherwise) place them in the checkpoint's experts and intermediate rows. `w2_bias` is None on the
    ranks that do not add it (tensor parallel without expert parallel: all but rank 0)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, mxfp4: bool):
        super().__init__()
        experts, hidden = cfg.num_experts, cfg.hidden_size
        # (MXFP4: rows in whole blocks of 32, so that the down projection's blocks are never cut)
        self.tp, self.expert_parallel, self.expert_span, self.inter_span = place_experts(
            cfg, MXFP4_BLOCK if mxfp4 else 1
        )
        local_experts, local_inter = self.expert_span.size, self.inter_span.size
        # (HF's router: top-k of the logits, softmax over those k; the weights rounded to the hidden dtype.
        # Expert parallel: every token routed over all experts, then only this rank's pairs computed.)
        self.routing = Routing(
            cfg.num_experts_per_tok,
            weights_in_hidden_dtype=True,
            expert_offset=self.expert_span.start,
            local_experts=local_experts if self.expert_parallel else None,
            softmax_after_topk=True,
        )
        self.activation = ClampedSwiGLU(
            alpha=float(cfg.raw.get("swiglu_alpha", 1.702)), limit=float(cfg.raw.get("swiglu_limit", 7.0))
        )
        self.router = Linear(hidden, experts, True, dtype)  # (replicated: every rank routes every token alike)
        self.w13: nn.Parameter | Mxfp4Experts
        self.w2: nn.Parameter | Mxfp4Experts
        if mxfp4:
            self.w13 = Mxfp4Experts(local_experts, 2 * local_inter, hidden, dtype, parts=2)
            self.w2 = Mxfp4Experts(local_experts, hidden, local_inter, dtype)
        else:
            w13 = torch.empty(local_experts, 2 * local_inter, hidden, dtype=dtype)
            self.w13 = nn.Parameter(w13, requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(local_experts, hidden, local_inter, dtype=dtype), requires_grad=False)
        self.w13_bias = nn.Parameter(torch.empty(local_experts, 2 * local_inter, dtype=dtype), requires_grad=False)
        # The fused op adds w2_bias to each expert's output before weighting it: with the intermediate rows
        # split, each rank's output is a partial sum of that projection, and the bias must join only one.
        self.w2_bias: nn.Parameter | None = None
        if self.expert_parallel or self.tp.rank == 0:
            self.w2_bias = nn.Parameter(torch.empty(local_experts, hidden, dtype=dtype), requires_grad=False)
        self.packed13: ExpertPanels | None = None
        self.packed2: ExpertPanels | None = None

    def hf_checkpoint_slices(self, proj: str, suffix: str) -> tuple[slice, ...] | None:
        """The slice this rank loads of a Hugging Face checkpoint's stacked expert tensor, in its layout
        (before `_in_our_layout` turns it): `proj` gate_up_proj or down_proj, `suffix` "" (the float weight,
        [E, in, out]), "_bias", "_blocks" or "_scales" (MXFP4: [E, out, in / 32, ...]). None: all of it.
        Gate and up are interleaved along their output axis, so rows [a, b) are its [2a, 2b)."""
        if self.expert_parallel:
            return (self.expert_span.slice(),)
        if not self.tp.parallel:
            return None
        rows = self.inter_span
        if proj == "gate_up_proj":
            interleaved = slice(2 * rows.start, 2 * rows.stop)
            return (slice(None), slice(None), interleaved) if suffix == "" else (slice(None), interleaved)
        if suffix == "_bias":
            return None  # (whole, on rank 0 only: the other ranks do not read it, see `_target`)
        if suffix == "":  # (down_proj [E, I, H])
            return (slice(None), rows.slice())
        return (slice(None), slice(None), self._blocks())

    def stacked_checkpoint_slices(self, proj: str, kind: str) -> tuple[slice, ...] | None:
        """The same for a projection stored rows first ([E, out, in], a GGUF file's): gate_proj / up_proj
        cut along their rows, down_proj along its columns (MXFP4: whole blocks of them)."""
        if self.expert_parallel:
            return (self.expert_span.slice(),)
        if not self.tp.parallel:
            return None
        if proj == "gate_up_proj":
            raise ValueError(
                "gpt-oss: this file joins each expert's gate and up projections (ffn_gate_up_exps), which tensor "
                "parallel cannot cut as one slice; use --enable-expert-parallel, or a file with them apart"
            )
        if proj in ("gate_proj", "up_proj"):
            return (slice(None), self.inter_span.slice())
        if kind == "bias":
            return None  # (whole, on rank 0 only, as above)
        return (slice(None), slice(None), self._blocks() if kind in ("blocks", "scales") else self.inter_span.slice())

    def _blocks(self) -> slice:
        """This rank's intermediate rows as MXFP4 blocks of the down projection's columns."""
        return slice(self.inter_span.start // MXFP4_BLOCK, self.inter_span.stop // MXFP4_BLOCK)

    def shard_count(self, param: torch.Tensor) -> int:
        """Checkpoint tensors that fill `param` (engine_core/models/checkpoint.py): w13's and its bias's gate
        rows and up rows come apart; the rest whole."""
        return 2 if param is self.w13 or param is self.w13_bias else 1

    def shard(self, index: int, param: torch.Tensor) -> torch.Tensor:
        """The view of `param` checkpoint shard `index` fills: w13's gate rows (0) or up rows (1)."""
        if param is self.w13 or param is self.w13_bias:
            half = param.shape[1] // 2
            return param[:, index * half : (index + 1) * half]
        return param

    def pack_for_cpu(self) -> bool:
        """Pack float32 CPU experts into panels for the fused MoE's C kernel and release the plain stacked
        weights (as `MoEMLP.pack_for_cpu` does); True if packed. MXFP4 experts need nothing: the kernel
        reads their blocks as stored. Where the C kernel is off the experts stay as they are."""
        if isinstance(self.w13, Mxfp4Experts) or isinstance(self.w2, Mxfp4Experts):
            return False
        return pack_experts_for_cpu(self)

    def experts(self) -> tuple[ExpertWeights, ExpertWeights]:
        """(w13, w2) as the op takes them: the panels where packed, else the tensors or MXFP4 storage."""
        return experts_of(self)

    def packed_bytes(self) -> int:
        """Bytes the packed experts hold (the parameters count the plain and MXFP4 ones)."""
        return sum(p.nbytes() for p in (self.packed13, self.packed2) if p is not None)

    def reads_host(self, device: torch.device) -> bool:
        """Always: its experts' options (biases, the clamped SwiGLU) run the fused op's torch reference, which
        loops over the chosen experts on the host (engine_core/cuda_graphs.py `model_capturable`)."""
        return True

    def forward(self, x: torch.Tensor, bulk_rows_from: int | None = None) -> torch.Tensor:
        logits = self.router(x).float()
        w13, w2 = self.experts()
        out = ops.fused_moe(
            x,
            logits,
            w13,  # (panels, MXFP4 storage the C kernel reads as it is, or a tensor)
            w2,
            self.routing,
            w13_bias=self.w13_bias,
            w2_bias=self.w2_bias,
            activation=self.activation,
        )
        # Under tensor parallel `out` is this rank's partial sum (its rows of every expert, or its experts'
        # pairs): one all-reduce per layer adds them.
        return self.tp.all_reduce(out)


class GptOssForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, pooling: bool = False):
        name = cfg.architecture
        if weights_deferred():  # (built for a quantization method, which fills Linears and MoEMLP's experts only)
            raise ValueError(
                f"{name} is a mixture-of-experts model: quantized weights (--quantization at load, or a quantized "
                "checkpoint other than its MXFP4) are not supported for it; serve its MXFP4 or float checkpoint "
                "without --quantization"
            )
        if cfg.layer_types and len(cfg.layer_types) != cfg.num_layers:
            raise ValueError(f"{name}: layer_types names {len(cfg.layer_types)} layers, the model has {cfg.num_layers}")
        # (the engine checks the split before any worker starts; a rank built otherwise checks it here, so that
        # MXFP4 experts are never cut inside a block)
        group, stage = building_group(), building_stage()
        check_model_splits(cfg, group.world_size, stage.count, building_expert_parallel())
        self.mxfp4 = uses_mxfp4(cfg)
        super().__init__(cfg, dtype, pooling)
        windows = self.attention_windows()
        for i in self.layer_range:
            attn = cast(LlamaDecoderLayer, self.layers[i]).self_attn.attn
            attn.sliding_window = windows[i]
            attn.sinks = nn.Parameter(torch.empty(attn.num_heads, dtype=dtype), requires_grad=False)
        # This rank's query heads, as its q projection holds them: the sinks it loads (one per head).
        attention = self.decoder_layers()[0].self_attn
        self.sink_heads = Span(attention.qkv_proj.out_spans[0].start // cfg.head_dim, attention.num_heads)

    def attention_windows(self) -> list[int | None]:
        # (no layer_types: HF's default, sliding in the even layers, full in the odd ones; indices are the
        # model's, not this pipeline stage's)
        cfg = self.cfg
        kinds = cfg.layer_types or tuple("sliding_attention" if i % 2 == 0 else "full" for i in range(cfg.num_layers))
        return [cfg.sliding_window if kind == "sliding_attention" else None for kind in kinds]

    def mlp_for(self, layer_index: int, dtype: torch.dtype) -> nn.Module:
        return GptOssMLP(self.cfg, dtype, self.mxfp4)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], assembler: LinearAssembler | None = None
    ) -> None:
        super().load_weights(self._in_our_layout(weights), assembler)

    def _in_our_layout(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The experts' tensors as stacked projections, rows first (`_STACKED`), gate and up apart: HF's float
        weights transposed to [E, out, in] and every gate_up tensor's rows split (HF's interleaved, a GGUF's
        joined gate_up halves). Views: nothing is copied until the parameters take them. Under
        tensor parallel they arrive already cut to this rank's piece (`checkpoint_slices`): whole gate/up
        pairs of an interleaved tensor, so the same split holds."""
        for name, tensor in weights:
            short = name.removeprefix("model.")
            hf = _HF_EXPERTS.match(short)
            stacked = _STACKED.match(short)
            if hf is not None:
                layer, proj, kind = hf[1], hf[2], _HF_KINDS[hf[3] or ""]
                if kind == "weight":
                    tensor = tensor.transpose(1, 2)  # [E, in, out] -> [E, out, in]
                prefix = f"layers.{layer}.mlp.experts."
                if proj == "gate_up_proj":
                    yield f"{prefix}gate_proj.{kind}", tensor[:, 0::2]
                    yield f"{prefix}up_proj.{kind}", tensor[:, 1::2]
                else:
                    yield f"{prefix}{proj}.{kind}", tensor
            elif stacked is not None and stacked[2] == "gate_up_proj":
                prefix, kind, half = f"layers.{stacked[1]}.mlp.experts.", stacked[3], tensor.shape[1] // 2
                yield f"{prefix}gate_proj.{kind}", tensor[:, :half]
                yield f"{prefix}up_proj.{kind}", tensor[:, half:]
            else:
                yield name, tensor

    def checkpoint_slices(self, name: str, assembled: bool) -> tuple[slice, ...] | None:
        if not self.tp.parallel:
            return None
        short = name.removeprefix("model.")
        hf, stacked = _HF_EXPERTS.match(short), _STACKED.match(short)
        if hf is not None and self._on_this_stage(f"layers.{hf[1]}"):
            return self._mlp(hf[1]).hf_checkpoint_slices(hf[2], hf[3] or "")
        if stacked is not None and self._on_this_stage(f"layers.{stacked[1]}"):
            return self._mlp(stacked[1]).stacked_checkpoint_slices(stacked[2], stacked[3])
        if hf is not None or stacked is not None:
            return None
        if short.endswith(".self_attn.sinks"):
            return (self.sink_heads.slice(),)
        return super().checkpoint_slices(name, assembled)

    def _mlp(self, layer: str) -> GptOssMLP:
        return cast(GptOssMLP, self.get_submodule(f"layers.{layer}.mlp"))

    def _target(self, name: str) -> tuple[str, int | None] | None:
        short = name.removeprefix("model.")
        hf = _HF_EXPERTS.match(short)
        if hf is not None:  # (a name as the checkpoint has it, before `_in_our_layout`: asked by `holds`)
            proj = "down_proj" if hf[2] == "down_proj" else "gate_up_proj"
            short = f"layers.{hf[1]}.mlp.experts.{proj}.{_HF_KINDS[hf[3] or '']}"
        match = _STACKED.match(short)
        if match is not None:
            layer, proj, kind = match[1], match[2], match[3]
            if not self._on_this_stage(f"layers.{layer}"):
                return None
            if proj == "down_proj" and kind == "bias" and self._mlp(layer).w2_bias is None:
                return None  # (added on another rank: not even read, loader.py `keep`)
            # (gate and up joined, which only `holds` sees unsplit: they fill w13 as its gate and up do)
            ours, shard = _OURS["gate_proj" if proj == "gate_up_proj" else proj]
            return f"layers.{layer}.mlp.{ours}{_OUR_KINDS[kind]}", shard
        if short.endswith(".self_attn.sinks"):
            if not self._on_this_stage(short):
                return None
            return short.replace(".self_attn.sinks", ".self_attn.attn.sinks"), None
        return super()._target(name)
