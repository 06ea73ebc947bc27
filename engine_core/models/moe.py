"""The mixture-of-experts families: Qwen3-MoE, Qwen2-MoE and Mixtral.

Each is the Llama family's model (engine_core/models/llama.py) with some or all layers' MLP a mixture of
experts (`MoEMLP`), declared through the model's `mlp_for` seat: the attention, norms, rotary embedding,
embedding and LM head are the shared layers. The experts' routing, grouped GEMMs and weighted sum are
one op, `ops.fused_moe` (kernels/torch_ref/moe.py; on CUDA kernels/triton/moe.py).

Checkpoints store each expert's projections apart (`mlp.experts.E.gate_proj` / `up_proj` / `down_proj`;
Mixtral's `block_sparse_moe.experts.E.w1` / `w3` / `w2`); they load straight into the stacked
parameters `w13` [E, 2I, H] (gate rows, then up rows) and `w2` [E, H, I], one view per tensor.

Tensor parallel (engine_core/parallel): the router is replicated (every rank routes every token the
same way). By default each expert is split as a dense MLP is: every rank holds every expert's slice of
the intermediate rows (gate and up rows, the down projection's columns; unevenly when the ranks do not
divide I, as engine_core/parallel/sharding.py `split_rows` does). With expert parallel
(`--enable-expert-parallel`) each rank holds whole experts instead, a contiguous range (`split_experts`),
and computes only the (token, expert) pairs of its experts (`Routing.expert_offset` / `local_experts`);
attention stays split by heads, so every rank already holds every token and no token moves. Either way
each rank's output is a partial sum: the experts' and Qwen2-MoE's shared expert's (split as a dense MLP,
its down projection not reduced) are added on the rank and summed over the ranks in one all-reduce per
layer. Pipeline parallel holds whole MoE layers per stage, as it does dense ones.

After loading, `pack_for_cpu` packs float32 CPU experts into the panels of the CPU's matmul
(kernels/panels.py `ExpertPanels`) for the fused MoE's C kernel (kernels/cpu/moe.c) and releases the plain
stacked weights, as a dense `Linear` does; where the C kernels are off they stay plain (the reference).
Quantization at load (`--quantization int8|int4`) quantizes each expert's gate, up and down projections as
it would a dense linear's weight, each checkpoint tensor as it arrives (the stacked parameters are never
allocated in full precision), and stacks them (kernels/quantized.py `PackedExperts`); the router and the
shared expert's gate stay in full precision. Quantized checkpoints (GPTQ, AWQ, compressed-tensors'
integer formats, GGUF) store each expert's projections as a dense linear's (`qweight` / `qzeros` /
`scales`, `weight_packed` / `weight_scale`, ...): each expert's tensors are converted as a dense linear's
once they have all arrived and stacked the same way, keeping the checkpoint's integers, scales and zero
points; a router or shared-expert gate the checkpoint leaves in full precision loads as float. Under tensor
parallel each expert's tensors are read whole, converted, and cut to this rank's rows (gate, up) or columns
(down, with their groups' scales: groups must not straddle the ranks); under expert parallel a rank reads
its experts only.

Refused with an error naming the limit, never run wrong: FP8 experts (an FP8 checkpoint, compressed-tensors'
float-quantized, `--quantization fp8`: loader.py), act-order GPTQ experts (a g_idx that reorders each
expert's columns: the fused MoE reads them in order), experts a quantized checkpoint leaves in full
precision, and experts of one layer quantized differently (kernels/quantized.py); the fused CPU decode step
declines MoE layers (fused_decode.py), and CUDA graphs are not captured where the torch reference op runs
(its expert loop reads the routing on the host: cuda_graphs.py `model_capturable`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import cast

import torch
from torch import nn

from pagoda.engine_core.layers.linear import Linear, weights_deferred
from pagoda.engine_core.model_config import ModelConfig
from pagoda.engine_core.models.llama import LlamaForCausalLM
from pagoda.engine_core.models.llama_layers import LlamaMLP
from pagoda.engine_core.parallel.distributed import TPGroup, building_expert_parallel, building_group
from pagoda.engine_core.parallel.sharding import Span, split_experts, split_rows
from pagoda.engine_core.quantization.assembly import ExpertProjection
from pagoda.kernels import ops
from pagoda.kernels.panels import ExpertPanels
from pagoda.kernels.quantized import PackedExperts, PackedWeight, concat_rows
from pagoda.kernels.torch_ref.moe import ExpertWeights, Routing

# The tensor kinds of a checkpoint's expert projection: a float weight, or a quantized format's tensors
# (engine_core/quantization: GPTQ's and AWQ's, compressed-tensors', a GGUF file's blocks and type).
_EXPERT_KINDS = (
    "weight",
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
    "weight_packed",
    "weight_shape",
    "weight_scale",
    "weight_zero_point",
    "weight_g_idx",
    "input_scale",
    "gguf_blocks",
    "gguf_type",
)
# A checkpoint's per-expert tensor: layer, expert, projection.
_EXPERT = re.compile(
    rf"^layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.(?:{'|'.join(_EXPERT_KINDS)})$"
)
# projection -> (our stacked parameter, which half of w13: gate 0, up 1; None for w2)
EXPERT_PROJECTIONS = {
    "gate_proj": ("w13", 0),
    "up_proj": ("w13", 1),
    "down_proj": ("w2", None),
    "w1": ("w13", 0),  # Mixtral's names
    "w3": ("w13", 1),
    "w2": ("w2", None),
}


class MoEMLP(nn.Module):
    """A layer's mixture of experts: the router (a replicated Linear [E, H] -> float32 logits), each
    expert's SiLU-gated MLP stacked in `w13` and `w2`, and optionally a shared expert (Qwen2-MoE: a dense
    MLP scaled by sigmoid(shared_expert_gate(x)) and added to the routed sum).

    Under tensor parallel `expert_span` (expert parallel) or `inter_span` (otherwise) says which experts,
    and which of their intermediate rows, this rank's stacked weights hold, in checkpoint coordinates."""

    def __init__(self, cfg: ModelConfig, dtype, weights_in_hidden_dtype: bool):
        super().__init__()
        experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.tp, self.expert_parallel, self.expert_span, self.inter_span = place_experts(cfg)
        local_experts, local_inter = self.expert_span.size, self.inter_span.size
        self.inter = inter  # (each expert's intermediate size in the checkpoint)
        # (norm_topk_prob is always True for Mixtral: engine_core/model_config.py)
        self.routing = Routing(
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            weights_in_hidden_dtype,
            self.expert_span.start,
            local_experts if self.expert_parallel else None,
        )
        self.gate = Linear(hidden, experts, False, dtype)
        self.gate.quantize_at_load = False  # (routing: a few weights that decide which experts run)
        # Built for quantization at load (`deferred_weights`): the loader hands each expert's projection
        # quantized (`set_quantized_shard`), so the stacked weights are never allocated in full precision.
        device = "meta" if weights_deferred() else None
        w13 = torch.empty(local_experts, 2 * local_inter, hidden, dtype=dtype, device=device)
        self.w13 = nn.Parameter(w13, requires_grad=False)
        w2 = torch.empty(local_experts, hidden, local_inter, dtype=dtype, device=device)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        # The experts packed (float32 panels for the CPU's C kernel) or quantized, which replace w13 / w2.
        self.packed13: ExpertPanels | PackedExperts | None = None
        self.packed2: ExpertPanels | PackedExperts | None = None
        self._quantized_parts: dict[str, dict[int, PackedWeight]] = {"w13": {}, "w2": {}}  # (while loading)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if cfg.shared_expert_intermediate_size:
            # (split as a dense MLP; its partial sum joins the experts' in forward's one all-reduce)
            self.shared_expert = LlamaMLP(cfg, dtype, cfg.shared_expert_intermediate_size, reduce=False)
            self.shared_expert_gate = Linear(hidden, 1, False, dtype)
            self.shared_expert_gate.quantize_at_load = False

    def local_expert(self, expert: int) -> int | None:
        """Checkpoint expert `expert`'s index in this rank's stacked weights; None if another rank holds it."""
        local = expert - self.expert_span.start
        return local if 0 <= local < self.expert_span.size else None

    def checkpoint_slices(self, param: str) -> tuple[slice, ...] | None:
        """The slice of an expert's checkpoint tensor (gate/up [I, H] for `w13`, down [H, I] for `w2`) this
        rank loads: its intermediate rows, or columns of the down projection; None: all of it."""
        if not self.tp.parallel or self.expert_parallel:
            return None
        rows = self.inter_span.slice()
        return (rows,) if param == "w13" else (slice(None), rows)

    def checkpoint_projection(self, param: torch.Tensor) -> ExpertProjection:
        """What a checkpoint stores of one expert's projection into `param` (w13: gate or up [I, H]; w2: down
        [H, I]) and which piece of it this rank holds, for the quantization assembler, which reads experts
        whole and cuts them after converting (engine_core/quantization/assembly.py)."""
        hidden, inter = self.w2.shape[1], self.inter
        if param is self.w13:
            rows = None if self.inter_span.size == inter else self.inter_span.slice()
            return ExpertProjection((inter, hidden), rows=rows, world_size=self.tp.world_size)
        columns = None if self.inter_span.size == inter else self.inter_span.slice()
        return ExpertProjection((hidden, inter), columns=columns, world_size=self.tp.world_size)

    def shard_count(self, param: torch.Tensor) -> int:
        """Checkpoint tensors per stacked parameter: gate and up of each expert in w13, down in w2."""
        return param.shape[0] * (2 if param is self.w13 else 1)

    def shard(self, index: int, param: torch.Tensor) -> torch.Tensor:
        """The view of `param` checkpoint shard `index` fills: w13's (expert, half) = divmod(index, 2),
        w2's expert `index` (local indices: this rank's experts)."""
        if param is self.w13:
            expert, half = divmod(index, 2)
            inter = param.shape[1] // 2
            return param[expert, half * inter : (half + 1) * inter]
        return param[index]

    def set_quantized_shard(self, index: int, param: torch.Tensor, packed: PackedWeight) -> None:
        """Checkpoint shard `index` of `param` (w13 or w2, built deferred), quantized and packed; once all of a
        parameter's shards are in, its experts are stacked (`PackedExperts`): w13's gate and up rows of each
        expert first joined."""
        name = "w13" if param is self.w13 else "w2"
        parts = self._quantized_parts[name]
        parts[index] = packed
        if len(parts) < self.shard_count(param):
            return
        if name == "w13":
            experts = [concat_rows(name, [parts[2 * e], parts[2 * e + 1]]) for e in range(param.shape[0])]
            self.packed13 = PackedExperts.stack(name, experts)
        else:
            self.packed2 = PackedExperts.stack(name, [parts[e] for e in range(param.shape[0])])
        parts.clear()

    def pack_for_cpu(self) -> bool:
        return pack_experts_for_cpu(self)

    def experts(self) -> tuple[ExpertWeights, ExpertWeights]:
        return experts_of(self)

    def reads_host(self, device: torch.device) -> bool:
        """Whether the fused op reads values on the host on `device` (so no CUDA graph can capture it): the
        torch reference does (Triton turned off, or quantized experts, which the Triton kernel does not take)."""
        w13, _ = self.experts()
        return not isinstance(w13, torch.Tensor) or not ops.graph_safe("fused_moe", device)

    def packed_bytes(self) -> int:
        """Bytes the packed or quantized experts hold (the parameters count the plain ones)."""
        return sum(p.nbytes() for p in (self.packed13, self.packed2) if p is not None)

    def forward(self, x: torch.Tensor, bulk_rows_from: int | None = None) -> torch.Tensor:
        logits = self.gate(x).float()
        w13, w2 = self.experts()
        out = ops.fused_moe(x, logits, w13, w2, self.routing)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # (the gate scales each token's row: it commutes with the sum over the ranks)
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, bulk_rows_from)
        # Under tensor parallel `out` is this rank's partial sum (its intermediate rows of every expert, or
        # its experts' pairs, plus its share of the shared expert): one all-reduce per layer adds them.
        return self.tp.all_reduce(out)


def place_experts(cfg: ModelConfig, row_unit: int = 1) -> tuple[TPGroup, bool, Span, Span]:
    """This rank's share of a MoE layer, as it is being built: (its tensor-parallel group, whether experts
    are placed whole (expert parallel), the experts it holds, their intermediate rows it holds), the spans
    in checkpoint coordinates. Without expert parallel the rows are split in units of `row_unit`."""
    experts, inter = cfg.num_experts, cfg.moe_intermediate_size
    tp = building_group()
    expert_parallel = tp.parallel and building_expert_parallel()
    expert_span, inter_span = Span(0, experts), Span(0, inter)
    if expert_parallel:
        expert_span = split_experts(experts, tp.rank, tp.world_size)
    elif tp.parallel:
        inter_span = split_rows(inter, tp.rank, tp.world_size, row_unit)
    return tp, expert_parallel, expert_span, inter_span


def pack_experts_for_cpu(mlp) -> bool:
    """Pack an MoE layer's float32 CPU experts (`mlp.w13`, `mlp.w2`) into panels for the fused MoE's C kernel
    and release the plain stacked weights (like `Linear.pack_for_cpu`); True if packed. Where the C kernel
    is off, or the experts are already packed, they stay as they are."""
    if mlp.packed13 is not None:
        return False
    panels = cpu_panels(mlp.w13, mlp.w2)
    if panels is None:
        return False
    mlp.packed13, mlp.packed2 = panels
    mlp.w13 = nn.Parameter(torch.empty(0, dtype=mlp.w13.dtype), requires_grad=False)
    mlp.w2 = nn.Parameter(torch.empty(0, dtype=mlp.w2.dtype), requires_grad=False)
    return True


def experts_of(mlp) -> tuple[ExpertWeights, ExpertWeights]:
    """An MoE layer's (w13, w2) as the op takes them: packed or quantized where they are, else as built."""
    if mlp.packed13 is not None and mlp.packed2 is not None:
        return mlp.packed13, mlp.packed2
    return mlp.w13, mlp.w2


def cpu_panels(w13: torch.Tensor, w2: torch.Tensor) -> tuple[ExpertPanels, ExpertPanels] | None:
    """Stacked float32 CPU experts packed into panels for the fused MoE's C kernel (kernels/cpu/moe.c); None
    where they stay plain: on another device or dtype, or where the C kernel is off."""
    if w13.device.type != "cpu" or w13.dtype != torch.float32 or not ops.compiled("fused_moe", w13.device):
        return None
    return ExpertPanels.pack(w13), ExpertPanels.pack(w2)


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family model whose layers `cfg.is_moe_layer` names hold a `MoEMLP`."""

    weights_in_hidden_dtype = True  # (Qwen's routers round the weights to the hidden dtype; Mixtral's do not)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, pooling: bool = False):
        name = cfg.architecture
        if cfg.raw.get("use_sliding_window") and cfg.raw.get("model_type") in ("qwen2_moe", "qwen3_moe"):
            # (HF's layer_types make only some layers' attention sliding; ours would slide in all)
            raise ValueError(f"{name}: use_sliding_window is not supported for this family yet")
        super().__init__(cfg, dtype, pooling)

    def mlp_for(self, layer_index: int, dtype: torch.dtype) -> nn.Module:
        if not self.cfg.is_moe_layer(layer_index):
            return super().mlp_for(layer_index, dtype)
        return MoEMLP(self.cfg, dtype, self.weights_in_hidden_dtype)

    def checkpoint_slices(self, name: str, assembled: bool) -> tuple[slice, ...] | None:
        target = self._target(name)
        if target is not None and target[0].endswith((".mlp.w13", ".mlp.w2")):
            if assembled:  # (read whole: the assembler cuts each expert once converted, `checkpoint_projection`)
                return None
            module_path, _, param = target[0].rpartition(".")
            return cast(MoEMLP, self.get_submodule(module_path)).checkpoint_slices(param)
        return super().checkpoint_slices(name, assembled)

    def _target(self, name: str) -> tuple[str, int | None] | None:
        short = name.removeprefix("model.")
        match = _EXPERT.match(short)
        if match is not None and match[3] in EXPERT_PROJECTIONS:  # (other names: the Llama mapping refuses them)
            layer = match[1]
            if not self._on_this_stage(f"layers.{layer}"):
                return None
            # (expert parallel: another rank's expert is skipped, and not even read: loader.py `keep`)
            expert = cast(MoEMLP, self.get_submodule(f"layers.{layer}.mlp")).local_expert(int(match[2]))
            if expert is None:
                return None
            param, half = EXPERT_PROJECTIONS[match[3]]
            return f"layers.{layer}.mlp.{param}", expert if half is None else 2 * expert + half
        return super()._target(name.replace(".block_sparse_moe.", ".mlp."))


class Qwen3MoeForCausalLM(MoEForCausalLM):
    qk_norm = True


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """QKV biases (the config's qkv_bias) and a shared expert in every MoE layer."""


class MixtralForCausalLM(MoEForCausalLM):
    weights_in_hidden_dtype = False


def stacked_expert_pieces(
    name: str, tensor: torch.Tensor, mlp: MoEMLP, cut: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stacked experts as transformers 5 holds them in memory (`experts.gate_up_proj` [E, 2I, H]: gate rows
    then up rows; `experts.down_proj` [E, H, I]) as each expert's projections (views), named as transformers
    writes experts apart (`experts.E.gate_proj.weight`, ...). With `cut` (tensor parallel without a
    quantization assembler, which cuts after converting), each is cut to the rows or columns of `mlp`'s rank:
    the stacked tensor is read whole, since gate's and up's rows of one rank are two runs of it."""
    prefix = name.rpartition(".")[0]
    rows, columns = (mlp.checkpoint_slices(param) if cut else None for param in ("w13", "w2"))
    if name.endswith("gate_up_proj"):
        inter = tensor.shape[1] // 2
        for expert in range(tensor.shape[0]):
            for half, projection in enumerate(("gate_proj", "up_proj")):
                piece = tensor[expert, half * inter : (half + 1) * inter]
                yield f"{prefix}.{expert}.{projection}.weight", piece[rows] if rows is not None else piece
    else:
        for expert in range(tensor.shape[0]):
            yield (
                f"{prefix}.{expert}.down_proj.weight",
                tensor[expert][columns] if columns is not None else tensor[expert],
            )
