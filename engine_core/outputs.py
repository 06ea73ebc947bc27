"""The offline API's results, shaped like vLLM's (per-step deltas are `protocol.RequestDelta`)."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.engine_core.protocol import FinishReason


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None  # a str: compares equal to vLLM's "stop" / "length" / "abort"
    # Per generated token: {token_id: Logprob} holding the sampled token and the top-N (vLLM's shape).
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs (vLLM's shape): None for the first prompt token, then per prompt
    # token {token_id: Logprob} holding that token (its rank among all tokens) and the top-N (ranks 1..N).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # the pooled (and, as the model says, normalized) vector


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result for one prompt (vLLM's shape: `output.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
