"""The engine's configuration: one typed object, built once from CLI flags or keyword arguments."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported lazily: the server's parent and frontends never load it
    import torch


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'2GiB', '512MiB', '1.5G', '1000000' -> bytes (K/M/G/T with or without 'i' are powers of 1024)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 2GiB, 512MiB)")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024 ** " KMGT".index(unit or " "))


_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
           "half": "float16"}


def resolve_dtype(name: str, device: "torch.device") -> "torch.dtype":
    """'auto' = float32 on the CPU (the fast dtype there), bfloat16 on CUDA."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return getattr(torch, _DTYPES[name])
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose auto, float32, bfloat16 or float16") from None


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None = the default model
    dtype: str = "auto"
    device: str = "auto"  # auto = cuda when available, else cpu
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV pool; None = 2 GiB on CPU, profiled on CUDA
    gpu_memory_utilization: float = 0.9  # CUDA: share of the card this process may use, KV pool included
    enforce_eager: bool = False  # CUDA: no graph capture for decode steps
    load_format: str = "auto"  # auto = the checkpoint's safetensors; dummy = random weights (benchmarks)
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set (tests)
    max_num_batched_tokens: int = 2048
    max_joint_prefill_tokens: int = 256  # see Scheduler: how many prefill tokens several requests may share a step with
    max_num_seqs: int = 128
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU; default = torch's choice

    def __post_init__(self):
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError("block_size must be one of 8, 16, 32, 64, 128")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_joint_prefill_tokens < 1:
            raise ValueError("max_num_batched_tokens, max_joint_prefill_tokens and max_num_seqs must be positive")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError("load_format must be auto or dummy")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")

    def torch_device(self) -> "torch.device":
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
