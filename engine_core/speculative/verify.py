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
"""

from __future__ import annotations

from engine_core.request import Request


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
        if matcher.is_terminated():  # complete: nothing may follow
            return proposals[: index + 1]
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
