"""Turning a client's GenerateRequest into engine requests (how engine deltas become text deltas: sample.py).

Validation that needs the tokenizer or the engine's limits lives here, so HTTP clients and direct
ZeroMQ clients get the same checks and the same OpenAI-shaped errors.
"""

from __future__ import annotations

from pagoda.detok_proc.prompt_size import PromptTooLong, encode_within
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
