"""Every JSON body the HTTP server answers with, as msgspec types: what /openapi.json documents
(api_proc/openapi.py generates its schemas from these with msgspec.json.schema_components; none is
written by hand).

The handlers build their bodies as dicts (api_proc/openai_format.py); these types are checked against
what they really send by the schemathesis tests (tests/api_proc/test_openapi.py): every response of
every route must validate, and `forbid_unknown_fields` makes each schema closed, so a field the server
sends that is not here fails them.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    """(closed: additionalProperties false in the schema)"""


# ---- errors --------------------------------------------------------------------------------------


class ErrorDetail(_Body):
    message: str
    type: str  # "invalid_request_error", "server_error", ...
    param: str | None
    code: str | None


class ErrorResponse(_Body):
    """OpenAI's error envelope: every 4xx and 5xx of every route."""

    error: ErrorDetail


# ---- small routes ----------------------------------------------------------------------------------


class EngineState(_Body):
    index: int
    state: str
    message: str
    num_running: int


class Health(_Body):
    status: Literal["ok", "degraded", "unhealthy", "starting", "draining"]
    message: str | None = None
    seconds_since_engine_progress: float | None = None
    engines: list[EngineState] | None = None  # data parallel: each replica


class Load(_Body):
    """GET /load: what `pagoda router` balances on."""

    running: int
    waiting: int
    kv_cache_usage: float


class Version(_Body):
    version: str


class Model(_Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    quantization: str | None  # how the weights are stored; null: full precision
    weight_bytes: int


class ModelList(_Body):
    object: Literal["list"]
    data: list[Model]


class Tokenized(_Body):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class Detokenized(_Body):
    prompt: str


class PrefixCacheReset(_Body):
    status: Literal["ok"]
    num_blocks: int


class EngineNumbers(_Body):
    engine: int
    metrics: dict[str, float]


class Dashboard(_Body):
    """GET /dashboard.json: the web dashboard's numbers (detok_proc/dashboard.py)."""

    model: str
    now: float
    engines: list[EngineNumbers]
    server: dict[str, float]
    rates: dict[str, Any]
    latency: dict[str, Any]
    timeline: list[dict[str, Any]]


# ---- generation ------------------------------------------------------------------------------------


class PromptTokensDetails(_Body):
    cached_tokens: int


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class PromptLogprob(_Body):
    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: null for the first prompt token, then {token id: its logprob} per position
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(_Body):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: str | int | None
    prompt_logprobs: PromptLogprobs | None = None


class Completion(_Body):
    """POST /v1/completions; streamed, each event is one with `object` "text_completion" too."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # (in a stream: the last event, with stream_options.include_usage)


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[TokenLogprob]


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Body):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    stop_reason: str | int | None


class ChatCompletion(_Body):
    """POST /v1/chat/completions (not streamed)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class ToolCallDeltaFunction(_Body):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Body):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallDeltaFunction | None = None


class ChatDelta(_Body):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Body):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    stop_reason: str | int | None


class ChatCompletionChunk(_Body):
    """One server-sent event of a streamed chat completion (`data: {...}`, then `data: [DONE]`)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None


# ---- embeddings ------------------------------------------------------------------------------------


class EmbeddingUsage(_Body):
    prompt_tokens: int
    total_tokens: int


class Embedding(_Body):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (encoding_format)


class EmbeddingList(_Body):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class Pooled(_Body):
    index: int
    object: Literal["pooling"]
    data: list[float | list[float]] | str  # one vector, or one per token (token_embed); or base64


class PoolingList(_Body):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Pooled]
    usage: EmbeddingUsage
