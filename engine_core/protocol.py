"""Every message that crosses a process boundary, as msgspec Structs encoded with msgpack.

Two one-way streams meet the engine core: `EngineInput` (requests, aborts, shutdown) arrives on its
PULL socket, `EngineOutput` (one batched message per step, rejections, ready, dead) leaves on its PUSH
socket. The frontend socket (detok_proc's ROUTER) speaks `FrontendRequest` / `FrontendResponse` with
its clients: the HTTP api_proc workers and any direct `EngineClient`. Tagged unions let one typed
decoder per direction read any message. Token arrays cross as packed int32 buffers (one bytes object,
not one Python int per token). This module imports no torch, so the API and tokenizer processes start
fast. msgpack only: nothing is ever pickled.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import msgspec
import numpy as np

from pagoda.engine_core.pooling.params import PoolingParams
from pagoda.engine_core.sampling_params import SamplingParams

# ---- into the engine core ----------------------------------------------------------------------


def pack_tokens(token_ids) -> bytes:
    """Token ids as one little buffer of int32 (a list, tuple or numpy array in)."""
    return np.asarray(token_ids, dtype=np.int32).tobytes()


def unpack_tokens(buffer: bytes) -> list[int]:
    return np.frombuffer(buffer, dtype=np.int32).tolist()


class AddRequest(msgspec.Struct, tag="add", array_like=True, gc=False):
    request_id: str
    prompt_tokens: bytes  # pack_tokens(prompt token ids)
    params: SamplingParams
    cache_salt: str | None = None  # only requests with equal salts share cached prefix blocks
    pooling: PoolingParams | None = None  # a pooling request (embedding model): `params` is unused


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", array_like=True):
    request_id: str  # answered by PrefixCacheReset with the same id


class AbortRequests(msgspec.Struct, tag="abort", array_like=True, gc=False):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Finish nothing more: exit the loop now (draining is the caller's decision)."""


EngineInput = AddRequest | AbortRequests | ResetPrefixCache | Shutdown

# ---- out of the engine core --------------------------------------------------------------------


class FinishReason(str, enum.Enum):
    """Why a request (one sample of a client's request) ended. Crosses the wire as its value; the
    `str` mixin makes a member equal to, and print as, that string, which is also OpenAI's word for it
    (except "abort", which the HTTP API reports as "stop")."""

    STOP = "stop"  # an EOS or stop token, a stop string, or a complete structured output
    LENGTH = "length"  # max_tokens, or the model's context, reached
    ABORT = "abort"  # aborted (AbortRequests, AbortRequest) before it ended by itself

    def __str__(self) -> str:  # the value, as str() gives for StrEnum (3.11+), on every version
        return self.value


class SampledAndTop(NamedTuple):
    """One generated token's logprobs as Python values (`TokenLogprobs.sampled_and_top()`)."""

    token_id: int  # the sampled token
    logprob: float  # its logprob
    top_ids: list[int]  # the k most likely tokens, best first (the sampled one may be among them)
    top_logprobs: list[float]  # their logprobs


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of one generated token, packed: column 0 is the sampled token, then the top k (best
    first). Two buffers instead of 2 + 2k Python numbers, whatever k is."""

    token_ids: bytes  # int32 [1 + k]
    logprobs: bytes  # float32 [1 + k]

    @classmethod
    def pack(cls, token_ids, logprobs) -> TokenLogprobs:
        return cls(np.asarray(token_ids, dtype=np.int32).tobytes(), np.asarray(logprobs, dtype=np.float32).tobytes())

    def unpack(self) -> tuple[list[int], list[float]]:
        """The two columns as lists, as given to `pack`."""
        return (
            np.frombuffer(self.token_ids, dtype=np.int32).tolist(),
            np.frombuffer(self.logprobs, dtype=np.float32).tolist(),
        )

    def sampled_and_top(self) -> SampledAndTop:
        """The sampled token and its logprob apart from the top k: what every reader wants."""
        (token_id, *top_ids), (logprob, *top_logprobs) = self.unpack()
        return SampledAndTop(token_id, logprob, top_ids, top_logprobs)


T = TypeVar("T")


class PromptLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of a prompt's tokens, packed: row i is prompt token i + 1 (the first token has no
    context, so no logprob: only its id is here); column 0 is that token, then the `num_top` most likely
    tokens at its position, best first. `ranks` holds each prompt token's rank among all tokens (1 = the
    most likely; ties count against it, as in vLLM). Three buffers, however long the prompt."""

    num_top: int
    first_token: int  # the prompt's first token id
    token_ids: bytes  # int32 [P - 1, 1 + num_top]
    logprobs: bytes  # float32 [P - 1, 1 + num_top]
    ranks: bytes  # int32 [P - 1]

    @classmethod
    def pack(cls, first_token: int, token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray) -> PromptLogprobs:
        """From arrays [P - 1, 1 + num_top], [P - 1, 1 + num_top] and [P - 1]."""
        token_ids = np.asarray(token_ids, dtype=np.int32)
        return cls(
            token_ids.shape[1] - 1,
            first_token,
            token_ids.tobytes(),
            np.asarray(logprobs, dtype=np.float32).tobytes(),
            np.asarray(ranks, dtype=np.int32).tobytes(),
        )

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token ids, logprobs, ranks) as read-only arrays shaped as in `pack`."""
        width = 1 + self.num_top
        return (
            np.frombuffer(self.token_ids, dtype=np.int32).reshape(-1, width),
            np.frombuffer(self.logprobs, dtype=np.float32).reshape(-1, width),
            np.frombuffer(self.ranks, dtype=np.int32),
        )

    def by_position(self, entry: Callable[[int, float, int], T]) -> list[dict[int, T] | None]:
        """vLLM's shape: None for the first prompt token, then per position a dict {token id:
        entry(token id, logprob, rank)} holding the prompt token first, with its rank, then the top
        `num_top` with ranks 1..num_top; a prompt token among those is listed once."""
        ids, logprobs, ranks = self.arrays()
        top_ranks = range(1, self.num_top + 1)
        out: list[dict[int, T] | None] = [None]
        for row_ids, row_logprobs, rank in zip(ids.tolist(), logprobs.tolist(), ranks.tolist(), strict=True):
            position = {row_ids[0]: entry(row_ids[0], row_logprobs[0], rank)}
            for token_id, logprob, top_rank in zip(row_ids[1:], row_logprobs[1:], top_ranks, strict=True):
                if token_id not in position:
                    position[token_id] = entry(token_id, logprob, top_rank)
            out.append(position)
        return out


class PooledVectors(msgspec.Struct, array_like=True, gc=False):
    """A pooling request's output: `rows` x `dim` little-endian float32 values in one buffer (one row for
    an embedding, one per prompt token for "token_embed"), never one Python float per value."""

    dim: int
    data: bytes

    @classmethod
    def pack(cls, array) -> PooledVectors:
        """From a [dim] or [rows, dim] array (any float dtype: stored as float32)."""
        values = np.asarray(array, dtype="<f4")
        return cls(values.shape[-1], values.tobytes())

    def array(self) -> np.ndarray:
        """[rows, dim] float32, read-only (a view of the buffer)."""
        return np.frombuffer(self.data, dtype="<f4").reshape(-1, self.dim)


class RequestDelta(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None  # on the request's last delta only
    new_logprobs: list[TokenLogprobs] = []
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache
    # On a request's first delta only: seconds from its arrival in the engine to its first scheduling.
    queue_time: float | None = None
    prompt_logprobs: PromptLogprobs | None = None  # on a request's first delta, when it asked for them
    pooled: PooledVectors | None = None  # a pooling request's output, on its one (finishing) delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodeStats(msgspec.Struct, array_like=True, gc=False):
    """Cumulative counters of speculative decoding (vLLM's vllm:spec_decode_* metrics)."""

    num_drafts: int  # verifications: a request's proposals checked in one step
    num_draft_tokens: int  # tokens proposed
    num_accepted_tokens: int  # of which the target kept
    accepted_per_position: list[int]  # [k]: how often the proposal at each position was kept


class SchedulerStatsMessage(msgspec.Struct, array_like=True, gc=False):
    """`EngineCore.stats()`: the scheduler's, sent as it is with every StepOutputs."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int  # cumulative counters from here on
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which were found there
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding on
    state_pool_usage: float | None = None  # recurrent state slots held, 0..1 (None: the model has none)


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True, gc=False):
    """One per engine step, and one per idle second with no deltas: a heartbeat that proves the loop
    is alive (the server's /health turns 503 when they stop)."""

    deltas: list[RequestDelta]
    stats: SchedulerStatsMessage
    timestamp: float


class RequestRejected(msgspec.Struct, tag="rejected", array_like=True):
    request_id: str
    message: str
    param: str | None = None  # the request field at fault, when known (e.g. "response_format")


class RequestFailed(msgspec.Struct, tag="failed", array_like=True):
    """A request ended by the engine mid-way because of its own data (its logits were not finite, or
    handling it raised): it alone fails, with a 500, and the engine goes on serving the others. The
    message is for the client: it names what happened, never an exception's text (that is logged)."""

    request_id: str
    message: str


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    model_dir: str
    pid: int = 0  # the engine process (the tokenizer process reports its process metrics)
    quantization: str | None = None  # how the weights are stored (QuantizationMethod.describe()); None: full precision
    weight_bytes: int = 0  # bytes the weights hold in memory
    # On CUDA (else 0): what the engine process's allocator holds once ready (weights, KV cache, CUDA
    # graphs), and the card's memory (the web dashboard and pagoda:device_memory_* show them).
    device_memory_used: int = 0
    device_memory_total: int = 0
    pooling: PoolingInfo | None = None  # an embedding model (`--runner pooling`): how it pools; None: it generates


class PoolingInfo(msgspec.Struct, array_like=True):
    """What a pooling engine serves: requests are checked against it before they reach the engine."""

    hidden_size: int  # an embedding's length
    pooling_type: str  # "mean", "cls" or "last"
    normalize: bool
    matryoshka: bool  # whether `dimensions` may shorten its embeddings
    matryoshka_dimensions: list[int] | None = None  # the lengths it supports, when its config lists them


class EngineDead(msgspec.Struct, tag="dead", array_like=True):
    message: str


class PrefixCacheReset(msgspec.Struct, tag="prefix_cache_reset", array_like=True):
    request_id: str
    num_blocks: int  # cached blocks forgotten


EngineOutput = StepOutputs | RequestRejected | RequestFailed | EngineReady | EngineDead | PrefixCacheReset

# ---- frontend: clients -> detok_proc ------------------------------------------------------------


class ChatOptions(msgspec.Struct, omit_defaults=True):
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict = {}
    tools: list[dict] | None = None  # OpenAI-shaped tools for the prompt (engine_core/tool_prompt.py)


class GenerateRequest(msgspec.Struct, tag="generate", kw_only=True, omit_defaults=True):
    """Exactly one of `prompt` (text), `prompt_tokens` (pack_tokens) or `messages` (chat) is set."""

    request_id: str  # unique among this client's requests
    params: SamplingParams
    prompt: str | None = None
    prompt_tokens: bytes | None = None
    messages: list[dict] | None = None
    chat: ChatOptions | None = None
    add_special_tokens: bool = True  # for text prompts (chat templates carry their own)
    stop: list[str] = []
    include_stop_str_in_output: bool = False
    return_prompt: bool = False  # echo: send the prompt's text and token ids in the first delta
    cache_salt: str | None = None
    # W3C traceparent of the span this request belongs to (the HTTP worker's): the tokenizer process
    # adds its spans under it (detok_proc/tracing.py, --otlp-traces-endpoint).
    trace_context: str | None = None


class EmbedRequest(msgspec.Struct, tag="embed", kw_only=True, omit_defaults=True):
    """Pool each of several inputs (an embedding model only): exactly one of `texts` or `token_ids` (each
    one input's pack_tokens). `truncate_prompt_tokens`: keep at most that many tokens of each input (the
    last ones of token ids; for texts the tokenizer's side, special tokens kept; -1: the model's maximum);
    without it an input longer than the model's maximum is refused. Answered by one EmbedResult."""

    request_id: str
    texts: list[str] | None = None
    token_ids: list[bytes] | None = None
    pooling: PoolingParams | None = None  # None: PoolingParams()
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True


class AbortRequest(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class TokenizeRequest(msgspec.Struct, tag="tokenize", kw_only=True, omit_defaults=True):
    request_id: str
    prompt: str | None = None
    messages: list[dict] | None = None
    chat: ChatOptions | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False  # the tokens' vocabulary strings too (TokenizeResult.token_strs)


# The requests that carry a prompt to tokenize (detok_proc/requests.py prompt_token_ids): both have
# `prompt`, `messages`, `chat` and `add_special_tokens`; only a GenerateRequest has `prompt_tokens`.
PromptRequest = GenerateRequest | TokenizeRequest


class DetokenizeRequest(msgspec.Struct, tag="detokenize"):
    request_id: str
    tokens: bytes  # pack_tokens


class HealthQuery(msgspec.Struct, tag="health"):
    request_id: str


class ResetPrefixCacheRequest(msgspec.Struct, tag="reset_prefix_cache"):
    request_id: str


class MetricsQuery(msgspec.Struct, tag="metrics"):
    """Answered by MetricsReport: every process's Prometheus metrics (detok_proc/metrics.py)."""

    request_id: str


class DashboardQuery(msgspec.Struct, tag="dashboard"):
    """Answered by DashboardReport: the web dashboard's data (detok_proc/dashboard.py)."""

    request_id: str


class ApiWorkerStats(msgspec.Struct, tag="api_stats", kw_only=True):
    """An HTTP worker's own counters, cumulative since it started; sent (no answer) at start-up and
    whenever one changes, so the tokenizer process can add them to every worker's /metrics."""

    pid: int
    worker: int = 0  # its number among the HTTP workers (its process title: "pagoda: api <worker>")
    rejected: dict[int, int] = {}  # requests refused, by HTTP status (429, 413)
    aborted: int = 0  # requests whose client disconnected before the response was complete
    timed_out: int = 0  # requests ended by the server's request timeout


FrontendRequest = (
    GenerateRequest
    | EmbedRequest
    | AbortRequest
    | TokenizeRequest
    | DetokenizeRequest
    | HealthQuery
    | ResetPrefixCacheRequest
    | MetricsQuery
    | DashboardQuery
    | ApiWorkerStats
)

# ---- frontend: detok_proc -> clients ------------------------------------------------------------


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    token: str
    token_id: int
    logprob: float
    top: list[tuple[str, int, float]]  # (token text, id, logprob), best first


class DecodedPromptLogprobs(msgspec.Struct, array_like=True, gc=False):
    """A prompt's logprobs with the text of every token id in them, each distinct id decoded once."""

    logprobs: PromptLogprobs
    texts: dict[int, str]  # token id -> its text, for every id in `logprobs` (`first_token` too)

    def by_position(self, entry: Callable[[float, int, str], T]) -> list[dict[int, T] | None]:
        """vLLM's shape (`PromptLogprobs.by_position`) with entry(logprob, rank, decoded token)."""
        texts = self.texts
        return self.logprobs.by_position(lambda token_id, logprob, rank: entry(logprob, rank, texts[token_id]))


class GenerateDelta(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """New text of one sample (`index` < n) of a request. The last delta of a sample has its
    `finish_reason`; every delta has the running token counts, so usage is exact at any point."""

    request_id: str
    index: int
    text: str
    tokens: bytes  # pack_tokens(new token ids)
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None = None
    prompt: str | None = None  # with return_prompt, on the first delta of index 0
    prompt_tokens: bytes | None = None
    prompt_logprobs: DecodedPromptLogprobs | None = None  # when asked for, on the first delta of index 0


class GenerateOutputs(msgspec.Struct, tag="outputs", gc=False):
    deltas: list[GenerateDelta]


class EmbedResult(msgspec.Struct, tag="embedded", gc=False):
    """An EmbedRequest's outputs, one per input in input order, and each input's token count."""

    request_id: str
    outputs: list[PooledVectors]
    num_prompt_tokens: list[int]

    def arrays(self) -> list[np.ndarray]:
        """Each input's vectors, [rows, dim] float32: one row for an embedding, one per token otherwise."""
        return [v.array() for v in self.outputs]

    def embeddings(self) -> np.ndarray:
        """[inputs, dim] float32: every input's embedding (task "embed")."""
        return np.concatenate(self.arrays())


class RequestError(msgspec.Struct, tag="error", kw_only=True):
    """A request failed; the fields are OpenAI's error envelope plus the HTTP status to answer with."""

    request_id: str
    status: int
    message: str
    error_type: str = "invalid_request_error"  # OpenAI's "type"
    param: str | None = None
    code: str | None = None


class TokenizeResult(msgspec.Struct, tag="tokenized"):
    request_id: str
    tokens: bytes
    token_strs: list[str] | None  # when asked for (TokenizeRequest.return_token_strs)
    max_model_len: int


class DetokenizeResult(msgspec.Struct, tag="detokenized"):
    request_id: str
    text: str


class EngineHealth(msgspec.Struct, kw_only=True):
    """One engine replica (`--data-parallel-size`) in a HealthReport."""

    index: int
    state: str  # "ok", "starting", "stalled", "restarting" (down, being restarted) or "down" (for good)
    message: str
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


class HealthReport(msgspec.Struct, tag="health", kw_only=True):
    request_id: str
    ready: bool  # an engine reported ready (model loaded, KV cache allocated, warm-up step run)
    healthy: bool  # an engine is ready, alive and making progress: requests are served
    message: str
    model: str  # the served model's directory
    max_model_len: int
    seconds_since_engine_progress: float
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    quantization: str | None = None  # the engine's, once ready (EngineReady)
    weight_bytes: int = 0
    degraded: bool = False  # healthy, but some engine replica is not serving (data parallel)
    engines: list[EngineHealth] = []  # each replica (data parallel; one entry with a single engine)


class PrefixCacheResetResult(msgspec.Struct, tag="prefix_cache_reset"):
    request_id: str
    num_blocks: int


class MetricsReport(msgspec.Struct, tag="metrics"):
    request_id: str
    text: bytes  # Prometheus text exposition format


class DashboardReport(msgspec.Struct, tag="dashboard"):
    request_id: str
    json: bytes  # GET /dashboard.json's body, encoded once here


FrontendResponse = (
    GenerateOutputs
    | EmbedResult
    | RequestError
    | TokenizeResult
    | DetokenizeResult
    | HealthReport
    | PrefixCacheResetResult
    | MetricsReport
    | DashboardReport
)

encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(EngineInput)
output_decoder = msgspec.msgpack.Decoder(EngineOutput)
frontend_request_decoder = msgspec.msgpack.Decoder(FrontendRequest)
frontend_response_decoder = msgspec.msgpack.Decoder(FrontendResponse)
