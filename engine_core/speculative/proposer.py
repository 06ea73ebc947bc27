"""Which running requests get proposals this step, and how many tokens each; the n-gram proposer.

`Proposer` is the interface a speculative method implements (`_propose`: the tokens themselves); its
`propose` decides who may propose how many. The verify step is the target's (verify.py): it needs only
the proposals, and for a draft that sampled them, the distributions it sampled from.

Speculation stands down when it would slow the server: for the whole step when more requests run than
`disable_batch_size` (verifying k more tokens each then costs more than the forward passes it saves), and
for a request whose proposals have rarely held (under 10 % of at least 32 proposed tokens; it is tried
again every 16 tokens, in case the text turned repetitive). A request gets no more proposals than its
max_tokens and the context can take.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import numpy as np

from pagoda.engine_core.request import Request
from pagoda.engine_core.speculative.config import SpeculativeConfig
from pagoda.engine_core.speculative.ngram import propose_ngram
from pagoda.engine_core.speculative.verify import grammar_prefix

_MIN_EVIDENCE = 32  # proposed tokens before a request's acceptance rate is judged
_MIN_ACCEPTANCE = 0.1
_RETRY_EVERY = 16  # output tokens between tries for a request judged unprofitable


class Proposer(ABC):
    """A speculator's first half: what each decoding request proposes for its next step (the second half,
    verification, is the target's step: verify.py). Subclasses say how (`_propose`); this decides who
    may propose and how many tokens."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.seconds = 0.0  # time spent proposing (benchmarks/spec_decode.py reports it per step)
        self.calls = 0

    def propose(self, running: list[Request]) -> None:
        """Set `spec_token_ids` (and `spec_draft_probs`) of every running request (empty where it gets
        none this step)."""
        started = time.perf_counter()
        for request in running:
            request.spec_token_ids, request.spec_draft_probs = [], None
        if len(running) <= self.config.disable_batch_size:
            wanted = [(request, k) for request in running if (k := self._room(request)) > 0]
            if wanted:
                self._propose(wanted)
        self.seconds += time.perf_counter() - started
        self.calls += 1

    @abstractmethod
    def _propose(self, wanted: list[tuple[Request, int]]) -> None:
        """Set the proposals of each (request, at most this many tokens)."""

    def _room(self, request: Request) -> int:
        """How many tokens the request may propose now (0: none)."""
        if request.num_output_tokens == 0 or request.num_computed_tokens != request.num_tokens - 1:
            return 0  # only a decoding request (its prompt done, its last token to compute)
        unprofitable = (
            request.spec_proposed >= _MIN_EVIDENCE and request.spec_accepted < _MIN_ACCEPTANCE * request.spec_proposed
        )
        if unprofitable and request.num_output_tokens % _RETRY_EVERY:
            return 0
        k = self.config.num_speculative_tokens
        params = request.params
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - request.num_output_tokens - 1)  # the last one comes from the target
        return min(k, self.max_model_len - request.num_tokens)


class NgramProposer(Proposer):
    """Prompt lookup (ngram.py), a request at a time."""

    def _propose(self, wanted: list[tuple[Request, int]]) -> None:
        for request, k in wanted:
            tokens = np.asarray(request.all_token_ids, dtype=np.int64)
            proposals = propose_ngram(tokens, self.config.prompt_lookup_min, self.config.prompt_lookup_max, k)
            if proposals and request.grammar is not None:
                proposals = grammar_prefix(request.grammar, proposals)
            request.spec_token_ids = proposals
