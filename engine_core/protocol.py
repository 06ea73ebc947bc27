"""Every message that crosses a process boundary, as msgspec Structs encoded with msgpack.

Two one-way streams meet the engine core: `EngineInput` (requests, aborts, shutdown) arrives on its
PULL socket, `EngineOutput` (one batched message per step, rejections, ready, dead) leaves on its PUSH
socket. Tagged unions let one typed decoder per socket read any message of its direction. This module
imports no torch, so the API and tokenizer processes start fast.
"""

from __future__ import annotations

from typing import Union

import msgspec

from engine_core.sampling_params import SamplingParams

# ---- into the engine core ----------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add", array_like=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AbortRequests(msgspec.Struct, tag="abort", array_like=True, gc=False):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Finish nothing more: exit the loop now (draining is the caller's decision)."""


EngineInput = Union[AddRequest, AbortRequests, Shutdown]

# ---- out of the engine core --------------------------------------------------------------------

TokenLogprobs = tuple[float, list[tuple[int, float]]]  # (sampled token's logprob, [(id, logprob), ...])


class RequestDelta(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the request's last delta
    new_logprobs: list[TokenLogprobs] = []
    num_prompt_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStatsMessage(msgspec.Struct, array_like=True, gc=False):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True, gc=False):
    deltas: list[RequestDelta]
    stats: SchedulerStatsMessage
    timestamp: float


class RequestRejected(msgspec.Struct, tag="rejected", array_like=True):
    request_id: str
    message: str


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    model_dir: str


class EngineDead(msgspec.Struct, tag="dead", array_like=True):
    message: str


EngineOutput = Union[StepOutputs, RequestRejected, EngineReady, EngineDead]

encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(EngineInput)
output_decoder = msgspec.msgpack.Decoder(EngineOutput)
