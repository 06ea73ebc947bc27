"""Draft-model proposals: the draft model (draft_model.py) decodes k tokens for every decoding request, in
k forward passes batched over them.

Pass j computes the draft's K/V of the request's last token (j = 0) or of its proposal j, in the slots
those positions will have, and samples the next proposal from the draft's logits processed as the
target's sampler would process the target's at that point (penalties, logit_bias, min_tokens, the grammar
having taken the proposals before, temperature, top-k/top-p/min-p): greedy requests take its argmax,
sampling ones a draw from the request's own generator, and keep the distribution for rejection sampling
(verify.py). The slots are taken from the KV cache for the passes and given back afterwards; the
verifying step takes them again and recomputes those positions for both models, with the same tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagoda.engine_core.kv_cache import KVCacheManager
from pagoda.engine_core.request import Request
from pagoda.engine_core.sampler import SamplingBatch, distributions
from pagoda.engine_core.speculative.config import SpeculativeConfig
from pagoda.engine_core.speculative.proposer import Proposer
from pagoda.engine_core.speculative.verify import DraftPosition, ForkedGrammar, draw, grammar_prefix

if TYPE_CHECKING:
    from pagoda.engine_core.model_runner import ModelRunner


class DraftProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, max_model_len: int, runner: ModelRunner, kv: KVCacheManager):
        super().__init__(config, max_model_len)
        assert runner.draft is not None
        self.runner = runner
        self.kv = kv
        self.vocab_size = runner.draft.model_cfg.vocab_size

    def _propose(self, wanted: list[tuple[Request, int]]) -> None:
        # Slots for the positions the passes write (the last token's, then each proposal's but the last);
        # a request the pool cannot give them to proposes nothing.
        wanted = [(request, k) for request, k in wanted if self.kv.allocate_slots(request, k)]
        drafts: dict[str, list[int]] = {request.request_id: [] for request, _ in wanted}
        probs: dict[str, list[torch.Tensor]] = {request.request_id: [] for request, _ in wanted}
        active = list(wanted)
        for j in range(max((k for _, k in wanted), default=0)):
            active = [(request, k) for request, k in active if k > j]
            if not active:
                break
            requests = [request for request, _ in active]
            tokens = [request.all_token_ids[-1] if j == 0 else drafts[request.request_id][-1] for request in requests]
            positions = [request.num_tokens - 1 + j for request in requests]
            logits = self.runner.draft_logits(requests, tokens, positions)
            views = [_view(request, drafts[request.request_id]) for request in requests]
            q = distributions(logits, SamplingBatch.from_requests(views, self.vocab_size))
            greedy = q.argmax(dim=-1).tolist()
            still = []
            for row, (request, k) in enumerate(active):
                mine = drafts[request.request_id]
                if request.params.temperature > 0:
                    row_q = q[row].cpu()
                    mine.append(draw(row_q, request.generator))
                    probs[request.request_id].append(row_q)
                else:
                    mine.append(greedy[row])
                if request.grammar is None or _grammar_open(request.grammar, mine):
                    still.append((request, k))
            active = still
        for request, _ in wanted:
            self.kv.trim(request)  # the slots past its tokens go back to the pool
            mine = drafts[request.request_id]
            if request.grammar is not None:
                mine = grammar_prefix(request.grammar, mine)
            request.spec_token_ids = mine
            if mine and probs[request.request_id]:
                request.spec_draft_probs = torch.stack(probs[request.request_id][: len(mine)])


def _view(request: Request, drafts: list[int]):
    """The request as the sampler sees it after `drafts` (itself before any)."""
    if not drafts:
        return request
    grammar = ForkedGrammar(request.grammar, drafts) if request.grammar is not None else None
    return DraftPosition(request, drafts, grammar)


def _grammar_open(grammar, drafts: list[int]) -> bool:
    """Whether the grammar takes every proposal and is not complete after them (else proposing stops)."""
    matcher = grammar.matcher.fork()
    return all(matcher.accept_token(token) for token in drafts) and not matcher.is_terminated()
