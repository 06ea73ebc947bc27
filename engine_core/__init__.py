"""Pagoda's engine core: scheduler, paged KV cache, model runner and the offline `LLM` API.

Kept lazy on purpose: `api_proc` and `detok_proc` import `pagoda.engine_core.protocol` without paying for torch.
"""

from typing import TYPE_CHECKING

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]

if TYPE_CHECKING:
    from pagoda.engine_core.llm import LLM
    from pagoda.engine_core.outputs import CompletionOutput, RequestOutput
    from pagoda.engine_core.sampling_params import SamplingParams
    from pagoda.engine_core.structured_params import StructuredOutputsParams

_LAZY = {
    "LLM": "pagoda.engine_core.llm",
    "SamplingParams": "pagoda.engine_core.sampling_params",
    "StructuredOutputsParams": "pagoda.engine_core.structured_params",
    "RequestOutput": "pagoda.engine_core.outputs",
    "CompletionOutput": "pagoda.engine_core.outputs",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagoda.engine_core' has no attribute {name!r}")
