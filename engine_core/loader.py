"""Finding a model and streaming its safetensors weights into our modules in their final dtype."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pagoda.engine_core.gguf_model import gguf_model_dir, gguf_source, is_gguf_file

if TYPE_CHECKING:  # imported lazily: resolving a model directory must not load torch
    import torch

    from pagoda.engine_core.models import PoolingModel
    from pagoda.engine_core.models.llama import LlamaForCausalLM
    from pagoda.engine_core.parallel.distributed import TPGroup
    from pagoda.engine_core.parallel.stage import Stage
    from pagoda.engine_core.quantization.base import QuantizationMethod

# (checkpoint name, shape) -> the slice of it to read; None: all of it (tensor parallel: each rank's shard)
Selection = Callable[[str, tuple[int, ...]], "tuple[slice, ...] | None"]

logger = logging.getLogger(__name__)


def resolve_model(model: str | None) -> Path:
    """A local directory as is; a .gguf file as the model directory made from its metadata (once, in
    the cache: engine_core/gguf_model.py); None = the default model (prepared on first use); else a hub id."""
    if model is None:
        from pagoda.engine_core.default_model import ensure_default_model

        return ensure_default_model()
    path = Path(model).expanduser()
    if is_gguf_file(path):
        return gguf_model_dir(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        return path
    if path.exists() or model.count("/") != 1:
        raise FileNotFoundError(f"model {model!r} is neither a model directory, a .gguf file nor a hub id (owner/name)")
    from huggingface_hub import snapshot_download

    # HF-format shards only: some repos also hold the same weights in another layout (consolidated.*).
    patterns = ["*.json", "model*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]
    return Path(snapshot_download(model, allow_patterns=patterns))


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    files = sorted(model_dir.glob("model*.safetensors")) or sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


def iterate_weights(
    model_dir: Path, select: Selection | None = None, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard, or of the GGUF file the directory stands for;
    tensors are memory-mapped, one at a time. With `select`, only the slice it names of each tensor
    (safetensors reads just those bytes); with `keep`, only the tensors it keeps (a pipeline stage's:
    the others are not read). A file that cannot be read (truncated, corrupt header) is a ValueError
    naming it."""
    from safetensors import SafetensorError, safe_open

    source = gguf_source(model_dir)
    if source is not None:
        from pagoda.engine_core.gguf_weights import iterate_gguf_weights

        weights = iterate_gguf_weights(*source)
        if keep is not None:
            weights = ((name, tensor) for name, tensor in weights if keep(name))
        yield from (weights if select is None else select_slices(weights, select))
        return

    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    if keep is not None and not keep(name):
                        continue
                    if select is None:
                        yield name, f.get_tensor(name)
                        continue
                    lazy = f.get_slice(name)
                    slices = select(name, tuple(lazy.get_shape()))
                    yield name, (f.get_tensor(name) if slices is None else lazy[slices])
        except SafetensorError as exc:
            raise ValueError(f"{path} is not a complete safetensors file (truncated or corrupt?): {exc}") from exc


def select_slices(weights: Iterator[tuple[str, torch.Tensor]], select: Selection) -> Iterator[tuple[str, torch.Tensor]]:
    """`select` applied to tensors that arrive whole (GGUF's memory-mapped arrays, dummy weights); the
    slice is copied, so the rest of the tensor is not kept."""
    for name, tensor in weights:
        slices = select(name, tuple(tensor.shape))
        yield name, (tensor if slices is None else tensor[slices].clone())


def load_model(
    model_dir: Path,
    model_cfg,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    quantization: QuantizationMethod | None = None,
    fp8_matmul: bool | None = None,
    group: TPGroup | None = None,
    stage: Stage | None = None,
    expert_parallel: bool = False,
) -> LlamaForCausalLM:
    """Build the model and fill it from the checkpoint; with a `quantization` method its linears are
    assembled from quantized tensors (or quantized as they stream by) without a full-precision copy.
    `fp8_matmul`: keep FP8 weights in FP8 (None: where the device multiplies in FP8). `group`: the
    tensor-parallel group this rank's shard of the model is for, `stage` the pipeline stage whose layers
    it holds (None: the whole model); `expert_parallel`: a mixture of experts' experts placed whole on the
    group's ranks (engine_core/models/moe.py)."""
    from pagoda.engine_core.models import model_class

    build = model_class(model_cfg.architecture)
    return _load(
        build, model_dir, model_cfg, dtype, device, load_format, quantization, fp8_matmul, group, stage, expert_parallel
    )


def load_pooling_model(
    model_dir: Path,
    model_cfg,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    quantization: QuantizationMethod | None = None,
    fp8_matmul: bool | None = None,
) -> PoolingModel:
    """`load_model` for a pooling model (an encoder, or a decoder without its LM head); one process."""
    from functools import partial

    from pagoda.engine_core.models import pooling_model_class

    build = partial(pooling_model_class(model_cfg.architecture), pooling=True)
    return _load(build, model_dir, model_cfg, dtype, device, load_format, quantization, fp8_matmul, None, None, False)


def _load(
    build, model_dir, model_cfg, dtype, device, load_format, quantization, fp8_matmul, group, stage, expert_parallel
):
    import contextlib
    from functools import partial

    import torch

    from pagoda.engine_core.layers.linear import deferred_weights
    from pagoda.engine_core.parallel.distributed import SINGLE, building_for
    from pagoda.engine_core.parallel.stage import WHOLE
    from pagoda.engine_core.quantization.assembly import LinearAssembler

    group, stage = group or SINGLE, stage or WHOLE
    if quantization is not None and model_cfg.is_moe and not quantization.loads_experts:
        # (a mixture of experts' experts take the integer layouts the fused MoE computes with: quantized at
        # load, or converted from GPTQ, AWQ, compressed-tensors INT and GGUF checkpoints; FP8 has none)
        raise ValueError(
            f"{model_cfg.architecture} is a mixture-of-experts model: quantized weights ({quantization.describe()}) "
            "are not supported for it; its experts load quantized from GPTQ, AWQ, compressed-tensors integer "
            "(pack-quantized, int-quantized) and GGUF checkpoints, or are quantized at load (--quantization int8 "
            "or int4 on a float checkpoint); or serve the float checkpoint without --quantization"
        )
    deferred = deferred_weights() if quantization is not None else contextlib.nullcontext()
    with torch.device(device), deferred, building_for(group, stage, expert_parallel):
        model = build(model_cfg, dtype)
    assembler = None if quantization is None else LinearAssembler(quantization, device, fp8_matmul)
    select = partial(_checkpoint_slices, model, assembler is not None) if group.parallel else None
    if load_format == "dummy":
        if assembler is not None:
            dummy = _dummy_weights(model_cfg, dtype)
            model.load_weights(dummy if select is None else select_slices(dummy, select), assembler)
        else:
            fill_dummy_weights(model)
    else:
        # (a stage's tensors only; under expert parallel, also this rank's experts only: others are not read)
        keep = model.holds if stage.count > 1 or group.parallel else None
        model.load_weights(iterate_weights(model_dir, select, keep), assembler)
    model.eval()
    _pack_linears(model)
    return model


def _checkpoint_slices(model, assembled: bool, name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
    return model.checkpoint_slices(name, assembled)


def weight_bytes(model) -> int:
    """Bytes the model's weights hold in memory (quantized and packed layouts as stored)."""
    from pagoda.engine_core.layers.linear import Linear
    from pagoda.engine_core.models.gpt_oss import GptOssMLP
    from pagoda.engine_core.models.moe import MoEMLP

    total = 0
    linear_params: set[int] = set()
    for module in model.modules():
        if isinstance(module, Linear):
            total += module.weight_bytes()
            linear_params.update(id(p) for p in module.parameters(recurse=False))
        elif isinstance(module, MoEMLP | GptOssMLP):
            total += module.packed_bytes()  # (and its plain stacked weights, if any: parameters, below)
    for param in model.parameters():
        if id(param) not in linear_params and not param.is_meta:
            total += param.numel() * param.element_size()
    return total


def _dummy_weights(model_cfg, dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Random full-precision checkpoint tensors, by checkpoint name, for a model built deferred (a
    quantized dummy model: benchmarks of the quantized kernels from a config.json alone)."""
    import torch

    from pagoda.engine_core.models import model_class

    with torch.device("meta"):
        shapes = model_class(model_cfg.architecture)(model_cfg, dtype)
    generator = torch.Generator().manual_seed(0)
    for name, param in shapes.named_parameters():
        yield from _checkpoint_tensors(shapes, name, param, generator)


def _checkpoint_tensors(model, name: str, param, generator):
    import torch

    from pagoda.engine_core.layers.linear import MergedLinear
    from pagoda.engine_core.models.moe import MoEMLP

    module_path = name.rpartition(".")[0]
    module = model.get_submodule(module_path) if module_path else None
    pieces = [(name, param.shape)]
    if isinstance(module, MoEMLP):  # (stacked experts: each expert's projections, as checkpoints hold them)
        experts, rows, columns = param.shape
        halves = [("gate_proj", rows // 2), ("up_proj", rows // 2)]
        projections = halves if name.endswith("w13") else [("down_proj", rows)]
        pieces = [
            (f"{module_path}.experts.{e}.{projection}.weight", (size, columns))
            for e in range(experts)
            for projection, size in projections
        ]
    if isinstance(module, MergedLinear):
        names = _SHARD_NAMES[module_path.rpartition(".")[2]]
        parent = module_path.rpartition(".")[0]
        kind = name.rpartition(".")[2]
        pieces = [
            (f"{parent}.{n}.{kind}", (size, *param.shape[1:])) for n, size in zip(names, module.out_sizes, strict=True)
        ]
    for piece, shape in pieces:
        if piece.endswith("norm.weight"):
            tensor = torch.ones(shape)
        elif len(shape) == 2:
            tensor = torch.randn(shape, generator=generator) * shape[-1] ** -0.5
        else:
            tensor = torch.randn(shape, generator=generator) * 0.02
        if piece == "lm_head.weight" and model.embed_tokens is None:
            piece = "embed_tokens.weight"  # tied: the checkpoint holds the table
        yield ("model." + piece if piece != "lm_head.weight" else piece), tensor.to(param.dtype)


_SHARD_NAMES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),  # (Qwen3.5's linear attention)
}


def fill_dummy_weights(model, seed: int = 0) -> None:
    """Random weights of the right shapes (std 1/sqrt(fan-in), norms at 1), so a model's speed can be
    measured from its config.json alone; a fixed seed keeps runs comparable."""
    import torch

    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    packed: set[int] = set()  # (parameters of modules that draw their own: stored formats such as MXFP4 experts)
    for module in model.modules():
        if hasattr(module, "fill_dummy"):
            module.fill_dummy(generator)
            packed.update(id(p) for p in module.parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if id(param) in packed:
                continue
            if name.lower().endswith("norm.weight"):  # (RMSNorm's and BERT's LayerNorm's scales)
                param.fill_(1.0)
            elif param.dim() >= 2:  # (a matrix, or an MoE layer's stacked expert matrices)
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
            else:
                param.normal_(0.0, 0.02, generator=generator)


def _pack_linears(model) -> None:
    """Repack CPU float32 linear weights for the CPU's matmul (see layers/linear.py), and mixtures of
    experts' stacked experts for the fused MoE's (models/moe.py, models/gpt_oss.py); a tied LM head's
    weight is also the embedding table."""
    from pagoda.engine_core.layers.linear import Linear
    from pagoda.engine_core.models.gpt_oss import GptOssMLP
    from pagoda.engine_core.models.moe import MoEMLP

    tied = getattr(model, "embed_tokens", 0) is None
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            module.pack_for_cpu(tied_embedding=tied and name.endswith("lm_head"))
        elif isinstance(module, MoEMLP | GptOssMLP):
            module.pack_for_cpu()
