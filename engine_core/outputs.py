"""What the engine hands back: per-step deltas (`StepOutput`) and the offline API's `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepOutput:
    """One request's progress in one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[tuple] = field(default_factory=list)  # (sampled logprob, [(id, logprob), ...])
    finish_reason: str | None = None
    num_prompt_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
    finish_reason: str | None
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
