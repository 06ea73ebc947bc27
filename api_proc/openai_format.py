"""Response bodies and stream chunks in OpenAI's exact shapes, built from the engine's text deltas."""

from __future__ import annotations

import time
import uuid

from engine_core.protocol import FinishReason, GenerateDelta, TokenLogprob


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: list[TokenLogprob]) -> list[dict]:
    """Chat API: one {"token", "logprob", "bytes", "top_logprobs"} per generated token."""
    return [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": _bytes(e.token),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": _bytes(t)} for t, _, lp in e.top],
        }
        for e in entries
    ]


class CompletionLogprobs:
    """Completions API: parallel lists tokens / token_logprobs / top_logprobs / text_offset."""

    def __init__(self, offset: int = 0):
        self.offset = offset  # characters of text before the next token

    def chunk(self, entries: list[TokenLogprob]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            out["tokens"].append(e.token)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({t: lp for t, _, lp in e.top} | {e.token: e.logprob})
            out["text_offset"].append(self.offset)
            self.offset += len(e.token)
        return out


class Choice:
    """Everything one sample produced, for a non-streamed response."""

    def __init__(self):
        self.text = ""
        self.finish_reason: str | None = None  # OpenAI's word for it (_openai_finish_reason)
        self.stop_reason = None
        self.logprob_entries: list[TokenLogprob] = []
        self.num_output_tokens = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0

    def add(self, delta: GenerateDelta) -> None:
        self.text += delta.text
        self.num_output_tokens = delta.num_output_tokens
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.logprobs:
            self.logprob_entries.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = _openai_finish_reason(delta.finish_reason)
            self.stop_reason = delta.stop_reason


def _openai_finish_reason(reason: FinishReason) -> str:
    """OpenAI's finish_reason for ours, a plain string: OpenAI has no "abort", so an aborted sample
    reports "stop". (With tools, "stop" may become "tool_calls" later: tool_parsing.py.)"""
    return FinishReason.STOP.value if reason is FinishReason.ABORT else reason.value


def finish_reason(delta: GenerateDelta) -> str | None:
    """The OpenAI finish_reason of a delta: None on all but a sample's last."""
    return None if delta.finish_reason is None else _openai_finish_reason(delta.finish_reason)


def envelope(kind: str, response_id: str, model: str, created: int | None = None, **fields) -> dict:
    return {"id": response_id, "object": kind, "created": created or int(time.time()), "model": model, **fields}
