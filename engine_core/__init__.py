"""Pagoda's engine core: scheduler, paged KV cache, model runner and the offline `LLM` API.

Kept lazy on purpose: `api_proc` and `detok_proc` import `engine_core.protocol` without paying for torch.
"""

from typing import TYPE_CHECKING

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]

if TYPE_CHECKING:
    from engine_core.llm import LLM
    from engine_core.outputs import CompletionOutput, RequestOutput
    from engine_core.sampling_params import SamplingParams
    from engine_core.structured_params import StructuredOutputsParams

_LAZY = {
    "LLM": "engine_core.llm",
    "SamplingParams": "engine_core.sampling_params",
    "StructuredOutputsParams": "engine_core.structured_params",
    "RequestOutput": "engine_core.outputs",
    "CompletionOutput": "engine_core.outputs",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine_core' has no attribute {name!r}")
