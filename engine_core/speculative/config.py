"""`--speculative-config`: which proposer, how many tokens it proposes, and when speculation stands down.

The JSON object is vLLM's spelling: `{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
"prompt_lookup_max": 5}`, or `{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}` (a
smaller model with the target's vocabulary: engine_core/speculative/draft_model.py). Pagoda adds
`disable_batch_size` (`--speculative-disable-batch-size` too): with more running requests than that, a step
does not speculate, because verifying k extra tokens per request then costs more than the tokens it saves
(the step is no longer bound by reading the weights).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
# Above this many running requests a step does not speculate (measured on the 2-core development machine,
# SmolLM2 fp32: benchmarks/spec_decode.py; docs/speculative-decoding.md).
DEFAULT_DISABLE_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_batch_size: int = DEFAULT_DISABLE_BATCH_SIZE
    model: str | None = None  # the draft model (draft_model only): a model directory or .gguf file

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported (one of: {', '.join(METHODS)})")
        if self.method == "draft_model" and not self.model:
            raise ValueError('--speculative-config: method "draft_model" needs "model": the draft model\'s path')
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f'--speculative-config: "model" is for method "draft_model", not {self.method!r}')
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be between 1 and 16")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be at least 1 and at most prompt_lookup_max")
        if self.disable_batch_size < 1:
            raise ValueError("disable_batch_size must be at least 1")

    @classmethod
    def parse(cls, text: str | None, disable_batch_size: int | None = None) -> SpeculativeConfig | None:
        """The config a `--speculative-config` JSON object gives (None: no speculation); a ValueError
        naming what is wrong."""
        if text is None:
            return None
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown key(s) {unknown} (known: {sorted(known)})")
        if disable_batch_size is not None:
            fields["disable_batch_size"] = disable_batch_size
        for name, value in fields.items():
            if name in ("method", "model"):
                if not isinstance(value, str):
                    raise ValueError(f"--speculative-config: {name} must be a string")
            elif not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"--speculative-config: {name} must be an integer")
        return cls(**fields)
