"""A request as the engine core tracks it: tokens, progress, KV blocks and its random generator."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import torch

from pagoda.engine_core.prompt_logprobs import PromptLogprobsCollector
from pagoda.engine_core.protocol import FinishReason
from pagoda.engine_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.engine_core.grammar_backend import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """Prompt + generated tokens, and how many of them already have K/V in the cache.

    The scheduler's one rule: `num_computed_tokens` catches up with `num_tokens`. Prefill, chunked
    prefill and decode are all that rule; preemption resets `num_computed_tokens` to 0.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[list[int]] = []  # per KV group (engine_core/kv_groups.py), its block table
        self.state_slot = 0  # its recurrent state's slot (engine_core/state_pool.py; 0: none)
        self.status = RequestStatus.WAITING
        self.cache_salt = cache_salt  # only requests with the same salt share cached prefix blocks
        self.block_hashes: list[bytes] = []  # of its full blocks, filled in by the KV cache manager
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache when first scheduled
        self.num_preemptions = 0
        self.scheduled_time: float | None = None  # time.monotonic() when first scheduled (queue time)
        self.generator: torch.Generator | None = None
        # Structured output: set once its grammar is compiled (engine_core/structured_output.py).
        self.grammar: RequestGrammar | None = None
        # Prompt logprobs still owed: gathered over the prefill, sent with the first token, then None.
        self.prompt_logprobs: PromptLogprobsCollector | None = None
        # Speculative decoding: tokens proposed for its next step (engine_core/speculative), and how its
        # proposals have fared (it stops being proposed for when they rarely hold).
        self.spec_token_ids: list[int] = []
        # [len(spec_token_ids), V]: the distributions a draft model sampled them from (None: point masses,
        # as n-gram proposals and greedy drafts are), for rejection sampling (speculative/verify.py)
        self.spec_draft_probs: torch.Tensor | None = None
        self.spec_proposed = 0
        self.spec_accepted = 0
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = PromptLogprobsCollector(params.prompt_logprobs, prompt_token_ids)
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether cached blocks may stand in for computing its first tokens: not while it owes prompt
        logprobs, which need the hidden state of every prompt position."""
        return self.prompt_logprobs is None

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to first scheduling; None until then."""
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.grammar is not None:  # the matcher follows exactly the tokens kept
            self.grammar.accept(token_id)

    def stop_status(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the last appended token puts this request in, if any."""
        token = self.all_token_ids[-1]
        params = self.params
        if self.grammar is not None and self.grammar.finished:  # complete: nothing may follow
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in self.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
