"""Prompt logprobs (vLLM's `prompt_logprobs`): for every prompt token but the first, its logprob given
the tokens before it, its rank among all tokens, and the top N at its position.

They come out of the prefill: the hidden state at position p gives the distribution of token p + 1.
A prompt prefilled in several chunks (chunked prefill, or a recompute after preemption) yields them
chunk by chunk; `PromptLogprobsCollector` keeps the parts until the request samples its first token,
whose delta carries them all. The logits of a chunk are made a slice of rows at a time, so a 32k-token
prompt never holds [32k, vocab] floats at once, only [max_rows, vocab].

Cached prefix blocks have no hidden states, so a request still owing its prompt logprobs reads nothing
from the prefix cache (`Request.reads_prefix_cache`); the blocks it computes are published as usual.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from pagoda.engine_core.protocol import PromptLogprobs


class PromptLogprobsChunk(NamedTuple):
    """The rows one step computed for one request: prompt tokens first_token .. first_token + R - 1."""

    first_token: int  # index in the prompt of the token in row 0 (at least 1)
    token_ids: np.ndarray  # int32 [R, 1 + num_top]: the prompt token, then the top num_top
    logprobs: np.ndarray  # float32 [R, 1 + num_top]
    ranks: np.ndarray  # int32 [R]


class PromptLogprobsCollector:
    """One request's prompt logprobs, gathered over its prefill steps until they are sent."""

    def __init__(self, num_top: int, prompt_token_ids: list[int]):
        self.num_top = num_top
        self.first_token = prompt_token_ids[0]
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_done = 0  # prompt tokens 1 .. num_done have their row
        self._parts: list[PromptLogprobsChunk] = []

    def positions_wanted(self, start: int, end: int) -> range:
        """Of the positions [start, end) a step computes, those whose hidden state gives a prompt token's
        row not collected yet (position p gives token p + 1; positions computed again after a
        preemption give nothing new)."""
        return range(max(start, self.num_done), min(end, self.num_prompt_tokens - 1))

    def add(self, chunk: PromptLogprobsChunk) -> None:
        if chunk.first_token != self.num_done + 1:
            raise AssertionError(f"prompt logprobs from token {chunk.first_token}, expected {self.num_done + 1}")
        self._parts.append(chunk)
        self.num_done += len(chunk.ranks)

    def pack(self) -> PromptLogprobs:
        """Every row, packed for the request's first delta; the prompt must be fully computed."""
        if self.num_done != self.num_prompt_tokens - 1:
            raise AssertionError(f"{self.num_done} of {self.num_prompt_tokens - 1} prompt logprobs computed")
        width = 1 + self.num_top
        if not self._parts:  # a one-token prompt: no token has a context
            return PromptLogprobs.pack(self.first_token, np.empty((0, width)), np.empty((0, width)), np.empty(0))
        return PromptLogprobs.pack(
            self.first_token,
            np.concatenate([p.token_ids for p in self._parts]),
            np.concatenate([p.logprobs for p in self._parts]),
            np.concatenate([p.ranks for p in self._parts]),
        )


def row_chunks(num_rows: int, max_rows: int) -> list[tuple[int, int]]:
    """The (start, end) row slices the LM head runs on, `max_rows` at a time (every tensor-parallel rank
    makes the same calls: engine_core/model_runner.py `follow`)."""
    return [(start, min(start + max_rows, num_rows)) for start in range(0, num_rows, max_rows)]


def compute_prompt_logprobs(
    model, hidden: torch.Tensor, targets: torch.Tensor, num_top: int, max_rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each row of `hidden` [R, H]: the logprob and rank of `targets[row]` (the next prompt token)
    and the top `num_top` tokens with their logprobs, from the float32 log-softmax of the model's
    logits. The LM head runs on at most `max_rows` rows at a time. Returns arrays shaped as in
    `PromptLogprobsChunk`."""
    num_rows = hidden.shape[0]
    token_ids = np.empty((num_rows, 1 + num_top), dtype=np.int32)
    logprobs = np.empty((num_rows, 1 + num_top), dtype=np.float32)
    ranks = np.empty(num_rows, dtype=np.int32)
    for start, end in row_chunks(num_rows, max_rows):
        row_logprobs = torch.log_softmax(model.compute_logits(hidden[start:end]), dim=-1)
        target = targets[start:end, None]
        target_logprobs = row_logprobs.gather(-1, target)
        top_logprobs, top_ids = row_logprobs.topk(num_top, dim=-1)
        token_ids[start:end] = torch.cat([target, top_ids], dim=1).cpu().numpy()
        logprobs[start:end] = torch.cat([target_logprobs, top_logprobs], dim=1).cpu().numpy()
        # vLLM's rank: how many tokens are at least as likely as this one (itself included).
        ranks[start:end] = (row_logprobs >= target_logprobs).sum(dim=-1).cpu().numpy()
    return token_ids, logprobs, ranks
