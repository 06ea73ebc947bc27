"""Response bodies and stream chunks in OpenAI's exact shapes, built from the engine's text deltas."""

from __future__ import annotations

import time
import uuid

from pagoda.engine_core.protocol import DecodedPromptLogprobs, FinishReason, GenerateDelta, TokenLogprob


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


def prompt_logprobs_json(prompt: DecodedPromptLogprobs) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token {token id: {"logprob",
    "rank", "decoded_token"}} holding the prompt token (with its rank) and the top N (ranks 1..N)."""
    return prompt.by_position(lambda logprob, rank, text: {"logprob": logprob, "rank": rank, "decoded_token": text})


class CompletionLogprobs:
    """Completions API: parallel lists tokens / token_logprobs / top_logprobs / text_offset."""

    def __init__(self, offset: int = 0):
        self.offset = offset  # characters of text before the next token

    def chunk(self, entries: list[TokenLogprob], echo: DecodedPromptLogprobs | None = None, num_top: int = 0) -> dict:
        """`echo`: the prompt's tokens come first, each with at most `num_top` alternatives; the first has
        null logprobs (nothing comes before it), as in vLLM."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if echo is not None:
            texts = echo.texts
            self._add(out, texts[echo.logprobs.first_token], None, None)
            ids, logprobs, _ = echo.logprobs.arrays()
            for row_ids, row_logprobs in zip(ids.tolist(), logprobs.tolist(), strict=True):
                token, logprob = texts[row_ids[0]], row_logprobs[0]
                alternatives = zip(row_ids[1 : 1 + num_top], row_logprobs[1 : 1 + num_top], strict=True)
                top = {texts[t]: lp for t, lp in alternatives}
                self._add(out, token, logprob, top | {token: logprob})
        for e in entries:
            self._add(out, e.token, e.logprob, {t: lp for t, _, lp in e.top} | {e.token: e.logprob})
        return out

    def _add(self, out: dict[str, list], token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        out["tokens"].append(token)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(self.offset)
        self.offset += len(token)


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
        self.prompt_logprobs: DecodedPromptLogprobs | None = None  # sample 0's, when asked for

    def add(self, delta: GenerateDelta) -> None:
        self.text += delta.text
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
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
