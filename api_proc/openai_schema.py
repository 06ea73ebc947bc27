"""OpenAI request bodies as typed msgspec Structs, and their translation into engine parameters.

msgspec checks types while it parses, so a wrong type is reported with the field's name; range checks
reuse `SamplingParams.validate` (its messages start with the field name). Every failure becomes an
`ApiError` carrying OpenAI's error fields.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.structured_params import StructuredOutputsParams
from pagoda.engine_core.validation import is_token_id, param_of

MAX_N = 128  # --max-n's default
MAX_LOGPROBS = 20
ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's chat roles


class ApiError(Exception):
    """An error answered in OpenAI's envelope. `closes`: what happens to the connection afterwards:
    None keeps it alive; "after_body" closes it once the rest of the body has been read (or ignored
    for a few seconds), so a client still sending can read the answer; "now" closes it as soon as the
    answer is out (the body is stalled or unreadable: waiting for it is pointless)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        error_type: str = "invalid_request_error",
        headers: dict | None = None,
        closes: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, error_type
        self.headers = headers or {}
        self.closes = closes

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    """Fields both endpoints take: OpenAI's, then vLLM's extras."""

    model: str | None = None
    temperature: float | None = None
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None  # requests share cached prefix blocks only with equal salts
    prompt_logprobs: int | None = None  # vLLM's: per prompt token its logprob, rank and this many top ones
    # Output constraints, read by api_proc/structured.py: OpenAI's, vLLM's current and vLLM's older names.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # refused: JSON whitespace is fixed
    guided_decoding_backend: str | None = None  # only "xgrammar" (or "auto") is served

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        constraint: StructuredOutputsParams | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """`constraint`: the request's one output constraint (api_proc/structured.py)."""
        if self.n < 1:  # the upper bound is the server's --max-n (ApiServer._limited)
            raise ApiError(
                400,
                f"Invalid 'n': expected a value of at least 1, but got {self.n} instead.",
                "n",
                "integer_below_min_value",
            )
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(
                400,
                f"Invalid 'max_tokens': expected a value >= 1, but got {max_tokens} instead.",
                "max_tokens",
                "integer_below_min_value",
            )
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"Invalid 'logprobs': expected a value in [0, {MAX_LOGPROBS}].", "logprobs")
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise ApiError(
                400, f"Invalid 'prompt_logprobs': expected a value in [0, {MAX_LOGPROBS}].", "prompt_logprobs"
            )
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos,
                stop_token_ids=self.stop_token_ids or [],
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                logit_bias=self._logit_bias(),
                structured_outputs=constraint,
            )
        except ValueError as exc:
            raise ApiError(400, str(exc), param_of(exc)) from None

    def _logit_bias(self) -> dict[int, float]:
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not _TOKEN_ID_KEY.fullmatch(key):  # ASCII digits only: int() would take "²" or 5,000 digits badly
                raise ApiError(400, f"Invalid 'logit_bias': key {_shown(key)} is not a token id.", "logit_bias")
            bias[int(key)] = value
        return bias

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list
    max_tokens: int | None = None  # unset: OpenAI's default, 16 (ApiSettings.completion_max_tokens)
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True

    def prompt_logprobs_count(self) -> int | None:
        """As vLLM: `echo` with `logprobs` needs the prompt's logprobs too, with as many top ones."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of text prompts or token-id prompts."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ApiError(400, "'prompt' must not be empty.", "prompt")
        if all(is_token_id(p) for p in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(is_token_id(t) for t in p) for p in prompt):
            return list(prompt)
        raise ApiError(
            400,
            "Invalid type for 'prompt': expected a string, a list of strings, a list of "
            "token ids (integers in [0, 2**31)) or a list of token-id lists.",
            "prompt",
            "invalid_type",
        )


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # api_proc/tools.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict]:
        """Messages with content parts joined into text, as string-based chat templates expect."""
        if not self.messages:
            raise ApiError(400, "'messages' must contain at least one message.", "messages")
        out = []
        for i, message in enumerate(self.messages):
            if not isinstance(message, dict):
                raise ApiError(
                    400,
                    f"Invalid type for 'messages[{i}]': expected a message object.",
                    f"messages[{i}]",
                    "invalid_type",
                )
            role, content = message.get("role"), message.get("content")
            if role not in ROLES:
                raise ApiError(
                    400,
                    f"Invalid 'messages[{i}].role': expected one of {', '.join(ROLES)}, but got {_shown(role)}.",
                    f"messages[{i}].role",
                )
            if isinstance(content, list):
                texts = []
                for part in content:
                    if (
                        not isinstance(part, dict)
                        or part.get("type") != "text"
                        or not isinstance(part.get("text"), str)
                    ):
                        raise ApiError(
                            400,
                            f"'messages[{i}].content' parts must be text parts; this model takes text only.",
                            f"messages[{i}].content",
                        )
                    texts.append(part["text"])
                content = "\n".join(texts)
            elif content is not None and not isinstance(content, str):
                raise ApiError(
                    400,
                    f"Invalid type for 'messages[{i}].content': expected a string or a list of text parts.",
                    f"messages[{i}].content",
                    "invalid_type",
                )
            if role == "assistant":
                _check_assistant_turn(i, message)
            out.append({**message, "content": content or ""})
        return out


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize: a text prompt, or chat messages rendered as /v1/chat/completions would."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True  # text prompts (a chat template carries its own)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    def chat_request(self) -> ChatCompletionRequest | None:
        if self.messages is None:
            if self.prompt is None:
                raise ApiError(
                    400,
                    "Missing required parameter: 'prompt' (a string) or 'messages'.",
                    "prompt",
                    "missing_required_parameter",
                )
            return None
        return ChatCompletionRequest(
            messages=self.messages, tools=self.tools, chat_template_kwargs=self.chat_template_kwargs
        )


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[int]


def _check_assistant_turn(i: int, message: dict[str, Any]) -> None:
    """OpenAI's rules for an assistant message: `tool_calls`, when given, is a list of well-formed calls
    (`{"id", "type": "function", "function": {"name", "arguments"}}`, the arguments as JSON text), and
    the message says something: `content`, or calls (then `content` may be null or absent). An empty
    list of calls counts as none (vLLM takes it; some clients send one)."""
    calls = message.get("tool_calls")
    where = f"messages[{i}].tool_calls"
    if calls is not None and not isinstance(calls, list):
        raise ApiError(400, f"Invalid type for '{where}': expected an array of tool calls.", where, "invalid_type")
    for j, call in enumerate(calls or []):
        _check_tool_call(f"{where}[{j}]", call)
    if message.get("content") is None and not calls and message.get("function_call") is None:
        raise ApiError(
            400,
            f"Missing required parameter: 'messages[{i}].content' (an assistant message needs 'content' "
            "or 'tool_calls').",
            f"messages[{i}].content",
            "missing_required_parameter",
        )


def _check_tool_call(where: str, call: object) -> None:
    if not isinstance(call, dict):
        raise ApiError(400, f"Invalid type for '{where}': expected a tool call object.", where, "invalid_type")
    _check_string(call, "id", where)
    if call.get("type") != "function":
        raise ApiError(
            400, f"Invalid '{where}.type': expected 'function', but got {_shown(call.get('type'))}.", f"{where}.type"
        )
    function = call.get("function")
    if not isinstance(function, dict):
        raise ApiError(
            400,
            f"Invalid '{where}.function': expected an object with 'name' and 'arguments'.",
            f"{where}.function",
            "missing_required_parameter" if function is None else "invalid_type",
        )
    _check_string(function, "name", f"{where}.function")
    _check_string(function, "arguments", f"{where}.function")  # JSON text, as responses carry it


def _check_string(parent: dict[str, Any], key: str, where: str) -> None:
    value = parent.get(key)
    if value is None:
        raise ApiError(
            400, f"Missing required parameter: '{where}.{key}'.", f"{where}.{key}", "missing_required_parameter"
        )
    if not isinstance(value, str):
        raise ApiError(400, f"Invalid type for '{where}.{key}': expected a string.", f"{where}.{key}", "invalid_type")


def _shown(value: object) -> str:
    """A client's value in an error message, cut short (never a whole 30 MB string)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,10}")
_PATH = re.compile(r"at `\$\.([A-Za-z_]+)")


def validation_error(exc: msgspec.ValidationError) -> ApiError:
    """The OpenAI-shaped 400 for a body whose fields have the wrong types."""
    text = str(exc)
    match = _PATH.search(text)
    param = match.group(1) if match else None
    if text.startswith("Object missing required field"):
        name = text.split("`")[1]
        return ApiError(400, f"Missing required parameter: '{name}'.", name, "missing_required_parameter")
    if text.startswith("Expected `object`") and param is None:
        return ApiError(400, "The request body must be a JSON object.", None, "invalid_type")
    return ApiError(400, f"Invalid type for '{param}': {text}", param, "invalid_type")
