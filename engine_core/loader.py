"""Finding a model and streaming its safetensors weights into our modules in their final dtype."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily: resolving a model directory must not load torch
    import torch

    from engine_core.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def resolve_model(model: str | None) -> Path:
    """A local directory as is; None = the default model (prepared on first use); else a hub id."""
    if model is None:
        from engine_core.default_model import ensure_default_model

        return ensure_default_model()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        return path
    if path.exists() or model.count("/") != 1:
        raise FileNotFoundError(f"model {model!r} is neither a model directory nor a hub id (owner/name)")
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


def iterate_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard; tensors are memory-mapped, one at a time."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                yield name, f.get_tensor(name)


def load_model(
    model_dir: Path, model_cfg, dtype: torch.dtype, device: torch.device, load_format: str = "auto"
) -> LlamaForCausalLM:
    import torch

    from engine_core.models import model_class

    cls = model_class(model_cfg.architecture)
    with torch.device(device):
        model = cls(model_cfg, dtype)
    if load_format == "dummy":
        fill_dummy_weights(model)
    else:
        model.load_weights(iterate_weights(model_dir))
    model.eval()
    _pack_linears(model)
    return model


def fill_dummy_weights(model, seed: int = 0) -> None:
    """Random weights of the right shapes (std 1/sqrt(fan-in), norms at 1), so a model's speed can be
    measured from its config.json alone; a fixed seed keeps runs comparable."""
    import torch

    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif param.dim() == 2:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
            else:
                param.normal_(0.0, 0.02, generator=generator)


def _pack_linears(model) -> None:
    """Hand CPU float32 linear weights to oneDNN's packed layout (see layers/linear.py). A tied LM
    head keeps its plain weight too: it is also the embedding table."""
    from engine_core.layers.linear import Linear

    tied = getattr(model, "embed_tokens", 0) is None
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            module.pack_for_cpu(keep_weight=tied and name.endswith("lm_head"))
