"""Verification: which proposed tokens the target model keeps.

A request with proposals d1..dk computes its last token and the proposals in one step, so the LM head
gives k + 1 rows: row j is the target's distribution for the token after d1..dj. The sampler draws one
token x_j from every row, each row processed as if d1..dj had been generated (penalties count them,
min_tokens sees them, a grammar has taken them: `DraftPosition`), and the request keeps the proposals
while they equal the draws, then the first draw that differs (or x_k when all held):
- greedy: x_j is row j's argmax, so the output is exactly what decoding one token at a time gives;
- sampling: a proposal is a point mass q = δ(d), for which rejection sampling (accept with probability
  min(1, p(d) / q(d)) = p(d), else draw from (p - q)+ normalised, i.e. from p without d) is the same as
  drawing x ~ p and keeping d when x = d, else x. Every kept token is distributed exactly as the target's.

A draft model that samples (temperature > 0) proposes d_j from its own distribution q_j, which it keeps
(`Request.spec_draft_probs`); such a request is verified by rejection sampling proper: d_j is kept with
probability min(1, p_j(d_j) / q_j(d_j)); the first one rejected is replaced by a draw from the normalised
(p_j - q_j)+; when all hold, one more token comes from row k + 1 (`rejection_sample`). Its uniforms and
draws come from the request's own generator, so a seeded request is reproducible. A greedy draft is a
point mass again.
"""

from __future__ import annotations

import torch

from pagoda.engine_core.protocol import TokenLogprobs
from pagoda.engine_core.request import Request
from pagoda.engine_core.sampler import SamplingBatch, distributions, gather_logprobs, sample


class DraftPosition:
    """A request as the sampler sees it at one verified row: its tokens, plus the proposals before the row."""

    __slots__ = (
        "eos_token_ids",
        "generator",
        "grammar",
        "num_output_tokens",
        "output_token_ids",
        "params",
        "prompt_token_ids",
        "stop_token_ids",
    )

    def __init__(self, request: Request, drafts_before: list[int], grammar):
        self.params = request.params
        self.prompt_token_ids = request.prompt_token_ids
        self.output_token_ids = request.output_token_ids + drafts_before
        self.num_output_tokens = len(self.output_token_ids)
        self.stop_token_ids = request.stop_token_ids
        self.eos_token_ids = request.eos_token_ids
        self.generator = request.generator  # (the request's draws, in row order: reproducible)
        self.grammar = grammar


class ForkedGrammar:
    """A request's grammar advanced over proposals, on a copy of its matcher (the request's own matcher
    takes only the tokens kept)."""

    __slots__ = ("backend", "matcher")

    def __init__(self, grammar, tokens: list[int]):
        self.backend = grammar.backend
        self.matcher = grammar.matcher.fork()
        for token in tokens:
            if not self.matcher.accept_token(token):
                raise ValueError(f"the grammar refuses proposed token {token}")


def grammar_prefix(grammar, proposals: list[int]) -> list[int]:
    """The longest prefix of `proposals` the grammar allows (a proposal it refuses is cut there)."""
    matcher = grammar.matcher.fork()
    for index, token in enumerate(proposals):
        if not matcher.accept_token(token):
            return proposals[:index]
        if matcher.is_terminated():  # it took its stop token: no row may follow it, so the target draws it
            return proposals[:index]
    return proposals


def sampler_views(request: Request, drafts: list[int]) -> list:
    """What the sampler samples for a request this step: itself, then one view per proposal."""
    views: list = [request]
    for j in range(1, len(drafts) + 1):
        grammar = ForkedGrammar(request.grammar, drafts[:j]) if request.grammar is not None else None
        views.append(DraftPosition(request, drafts[:j], grammar))
    return views


def accepted(draws: list[int], drafts: list[int]) -> list[int]:
    """The tokens a request keeps: its proposals while they equal the draws, then the next draw."""
    kept = 0
    while kept < len(drafts) and draws[kept] == drafts[kept]:
        kept += 1
    return drafts[:kept] + [draws[kept]]


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: list[int], generator) -> list[int]:
    """The tokens a request keeps of proposals `drafts` drawn from the rows of `q` [k, V], given the
    target's distributions `p` [k + 1, V] (row j: the token after drafts[:j]); `generator` (None: torch's
    global one) gives every uniform and draw."""
    for j, token in enumerate(drafts):
        if torch.rand((), generator=generator) * q[j, token] < p[j, token]:  # kept w.p. min(1, p/q)
            continue
        residual = (p[j] - q[j]).clamp_(min=0.0)
        return drafts[:j] + [draw(residual if residual.sum() > 0 else p[j], generator)]
    return drafts + [draw(p[len(drafts)], generator)]


def draw(weights: torch.Tensor, generator) -> int:
    """One index drawn with probability proportional to `weights` (CPU, float32): the exponential race."""
    noise = torch.empty(weights.shape, dtype=weights.dtype).exponential_(generator=generator)
    return int((weights / noise).argmax())


def verify(
    logits: torch.Tensor, requests: list[Request], proposals: list[list[int]], vocab_size: int
) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]], set[str]]:
    """Each request's new tokens (and their packed logprobs, when asked for) from its logits rows: one row
    per proposal plus one, the requests' rows one after another in `requests` order. Also the requests
    that get no token because a row of theirs was not finite (NaN or infinite logits): they have failed."""
    # (request, its proposals, its first row): point masses (n-gram, greedy) or drafts sampled from q
    point_masses: list[tuple[Request, list[int], int]] = []
    rejecting: list[tuple[Request, list[int], int]] = []
    row = 0
    for request, drafts in zip(requests, proposals, strict=True):
        sampled_draft = bool(drafts) and request.spec_draft_probs is not None and request.params.temperature > 0
        (rejecting if sampled_draft else point_masses).append((request, drafts, row))
        row += 1 + len(drafts)
    sampled: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprobs]] = {}
    failed: set[str] = set()
    if point_masses:
        rows = [first + j for _, drafts, first in point_masses for j in range(1 + len(drafts))]
        views = [view for request, drafts, _ in point_masses for view in sampler_views(request, drafts)]
        out = sample(logits if not rejecting else logits[rows], SamplingBatch.from_requests(views, vocab_size))
        failed_rows = set(out.failed_rows)
        offset = 0
        for request, drafts, _ in point_masses:
            if failed_rows.intersection(range(offset, offset + 1 + len(drafts))):
                failed.add(request.request_id)
                offset += 1 + len(drafts)
                continue
            kept = accepted(out.token_ids[offset : offset + 1 + len(drafts)], drafts)
            sampled[request.request_id] = kept
            if request.params.logprobs is not None:
                logprobs[request.request_id] = _present(out.logprobs[offset : offset + len(kept)])
            offset += 1 + len(drafts)
    for request, drafts, first in rejecting:
        views = sampler_views(request, drafts)
        rows_of = logits[first : first + 1 + len(drafts)]
        assert request.spec_draft_probs is not None
        p = distributions(rows_of, SamplingBatch.from_requests(views, vocab_size)).cpu()
        if not bool(torch.isfinite(p).all()):
            failed.add(request.request_id)
            continue
        kept = rejection_sample(p, request.spec_draft_probs[: len(drafts)].cpu(), drafts, request.generator)
        sampled[request.request_id] = kept
        if request.params.logprobs is not None:
            token_ids = torch.tensor(kept, dtype=torch.int64, device=logits.device)
            batch = SamplingBatch.from_requests(views[: len(kept)], vocab_size)
            logprobs[request.request_id] = _present(gather_logprobs(rows_of[: len(kept)], token_ids, batch))
    return sampled, logprobs, failed


def _present(logprobs: list[TokenLogprobs | None]) -> list[TokenLogprobs]:
    return [lp for lp in logprobs if lp is not None]
