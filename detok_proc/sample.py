"""One engine request's state in the tokenizer process: sample `index` of a client's request, with what the
metrics (SampleTiming) and the traces (SampleTrace) keep about it, and how its engine deltas become text
deltas. Kept apart from requests.py, metrics.py, tracing.py and dashboard.py so that each of them can
import it without importing the others."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagoda.detok_proc.incremental import IncrementalDetokenizer
from pagoda.engine_core import protocol


@dataclass
class SampleTiming:
    """One sample's life as this process saw it (time.monotonic()); kept on its SampleState."""

    arrival: float = field(default_factory=time.monotonic)
    admitted: float = field(default_factory=time.monotonic)  # tokenized and handed to the engine (made then)
    first_token: float | None = None
    last_token: float | None = None
    queue_time: float | None = None  # seconds, measured by the engine


@dataclass
class SampleTrace:
    """What one sample's spans need beyond SampleState.timing (times from the engine, wall clock)."""

    parent: Any  # the request's context (from GenerateRequest.trace_context)
    model: str
    first_step: float | None = None  # StepOutputs.timestamp of the step with its first token
    last_step: float | None = None
    busy: float = 0.0  # seconds this process spent turning its deltas into text
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache


@dataclass
class SampleState:
    """One engine request: sample `index` of a client's request."""

    identity: bytes
    client_request_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    num_prompt_tokens: int
    stop_token_ids: frozenset[int]
    logprobs: int | None
    engine: int = 0  # the engine replica running it (data parallel)
    prompt: str | None = None  # echo: sent once, with the first delta
    prompt_tokens: bytes | None = None
    num_output_tokens: int = 0
    timing: SampleTiming = field(default_factory=SampleTiming)  # for the metrics (detok_proc/metrics.py)
    trace: SampleTrace | None = None  # with --otlp-traces-endpoint, for a request that carries a trace context

    def delta(self, delta: protocol.RequestDelta, token_text) -> protocol.GenerateDelta:
        """The client's view of one engine delta. `token_text(id)` names a token for logprobs."""
        detok = self.detokenizer
        self.num_output_tokens += len(delta.new_token_ids)
        text = detok.add(delta.new_token_ids)
        finish_reason, stop_reason = delta.finish_reason, None
        if detok.stopped:
            finish_reason, stop_reason = protocol.FinishReason.STOP, detok.stop_reason
        elif finish_reason is not None:
            text += detok.flush()
            last = delta.new_token_ids[-1] if delta.new_token_ids else None
            if finish_reason is protocol.FinishReason.STOP and last in self.stop_token_ids:
                stop_reason = last
        out = protocol.GenerateDelta(
            request_id=self.client_request_id,
            index=self.index,
            text=text,
            tokens=protocol.pack_tokens(delta.new_token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=delta.num_cached_tokens,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        if self.logprobs is not None:
            out.logprobs = []
            for packed in delta.new_logprobs:
                token = packed.sampled_and_top()
                out.logprobs.append(
                    protocol.TokenLogprob(
                        token_text(token.token_id),
                        token.token_id,
                        token.logprob,
                        [(token_text(tid), tid, lp) for tid, lp in zip(token.top_ids, token.top_logprobs, strict=True)],
                    )
                )
        if delta.prompt_logprobs is not None:  # each distinct token id decoded once (and cached)
            packed = delta.prompt_logprobs
            distinct = np.unique(np.append(packed.arrays()[0], packed.first_token)).tolist()
            texts = {token_id: token_text(token_id) for token_id in distinct}
            out.prompt_logprobs = protocol.DecodedPromptLogprobs(packed, texts)
        if self.prompt is not None or self.prompt_tokens is not None:
            out.prompt, out.prompt_tokens = self.prompt, self.prompt_tokens
            self.prompt = self.prompt_tokens = None
        return out
