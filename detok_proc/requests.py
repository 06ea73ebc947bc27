"""Turning a client's GenerateRequest into engine requests, and engine deltas back into text deltas.

Validation that needs the tokenizer or the engine's limits lives here, so HTTP clients and direct
ZeroMQ clients get the same checks and the same OpenAI-shaped errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagoda.detok_proc.incremental import IncrementalDetokenizer
from pagoda.detok_proc.metrics import SampleTiming
from pagoda.detok_proc.prompt_size import PromptTooLong, encode_within
from pagoda.detok_proc.tracing import SampleTrace
from pagoda.engine_core import protocol
from pagoda.engine_core.tokenizer import render_chat
from pagoda.engine_core.validation import ParamError, check_token_ids


class RequestInvalid(Exception):
    """A client error, with the OpenAI error fields to answer it with."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        error_type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.param, self.code, self.status, self.error_type = param, code, status, error_type

    def to_message(self, request_id: str) -> protocol.RequestError:
        return protocol.RequestError(
            request_id=request_id,
            status=self.status,
            message=str(self),
            param=self.param,
            code=self.code,
            error_type=self.error_type,
        )

    @classmethod
    def of(cls, exc: ParamError) -> RequestInvalid:
        return cls(str(exc), exc.param)


def prompt_token_ids(tokenizer, request: protocol.PromptRequest, vocab_size: int, token_limit: int) -> list[int]:
    """The prompt of a Generate/TokenizeRequest as token ids (chat template applied for messages);
    RequestInvalid, naming the field, when there is none, it cannot be encoded, or it cannot fit in
    `token_limit` tokens (found without tokenizing all of a long text: prompt_size.py)."""
    param = "messages" if request.messages is not None else "prompt"
    try:
        if request.messages is not None:
            chat = request.chat or protocol.ChatOptions()
            try:
                text = render_chat(
                    tokenizer,
                    request.messages,
                    add_generation_prompt=chat.add_generation_prompt,
                    continue_final_message=chat.continue_final_message,
                    chat_template_kwargs=chat.chat_template_kwargs,
                    tools=chat.tools,
                )
            except ParamError:
                raise
            except Exception as exc:  # jinja raises many kinds; all are the client's input
                raise RequestInvalid(f"the chat template could not render these messages: {exc}", param) from exc
            # The template already holds any BOS/special tokens: do not add them again.
            ids = encode_within(tokenizer, text, token_limit, add_special_tokens=False)
        elif isinstance(request, protocol.GenerateRequest) and request.prompt_tokens is not None:
            ids = protocol.unpack_tokens(request.prompt_tokens)
            check_token_ids(ids, vocab_size, param)
        elif request.prompt is not None:
            ids = encode_within(tokenizer, request.prompt, token_limit, request.add_special_tokens)
        else:
            raise RequestInvalid("one of prompt, prompt token ids or messages is required", param)
    except ParamError as exc:
        raise RequestInvalid.of(exc) from None
    except PromptTooLong as exc:
        raise RequestInvalid(str(exc), param, "context_length_exceeded") from None
    if not ids:
        raise RequestInvalid("the prompt is empty", param)
    return ids


MAX_STOP_STRINGS = 64  # each is searched for in the text after every token: their number is the cost
MAX_STOP_CHARS = 1024


def check_request_options(request: protocol.GenerateRequest, vocab_size: int) -> None:
    """What a request asks for that cannot be honoured, refused before any work (OpenAI's 400)."""
    if any(not stop for stop in request.stop):
        raise RequestInvalid("Invalid 'stop': stop strings must not be empty.", "stop")
    if len(request.stop) > MAX_STOP_STRINGS or any(len(stop) > MAX_STOP_CHARS for stop in request.stop):
        raise RequestInvalid(
            f"Invalid 'stop': at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters each.",
            "stop",
        )
    try:
        check_token_ids(request.params.stop_token_ids, vocab_size, "stop_token_ids")
        check_token_ids(request.params.logit_bias, vocab_size, "logit_bias")
    except ParamError as exc:
        raise RequestInvalid.of(exc) from None


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str) -> None:
    """OpenAI's context_length_exceeded, with both numbers in the message."""
    wanted = num_prompt_tokens + (max_tokens or 1)
    if num_prompt_tokens >= max_model_len or wanted > max_model_len:
        raise RequestInvalid(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{wanted} tokens ({num_prompt_tokens} in the prompt, {max_tokens or 1} for the completion). "
            f"Please reduce the length of the prompt or of max_tokens.",
            param,
            "context_length_exceeded",
        )


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
