"""Vectorized sampling over a batch of logits rows.

Penalties, min_tokens masking, structured-output grammar masks, temperature, top-k, top-p and min-p
are applied to the whole batch with tensor ops; only requests with their own `seed` draw from their
own generator (so a seeded request gives the same tokens whatever else shares its batch).

A row is drawn by inverting its cumulative distribution with one uniform number: on the CPU that is
~20x cheaper than an exponential race (argmax(p / E), E ~ Exp(1) per vocabulary entry), whose
`exponential_` over [batch, vocab] took 29 ms of a 16-row step here (docs/decode-speed.md).

A row whose logits are not finite (NaN, or +inf, or every token masked) has no distribution to draw
from: it yields no token but is reported in `SamplerOutput.failed_rows`, and the engine fails that
request alone. The check costs O(rows): a greedy row's chosen logit is NaN or infinite exactly when
the row is bad (the argmax takes NaN as the largest), and a sampled row's softmax total is not 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.engine_core.grammar_backend import RequestGrammar, apply_grammar_bitmask
from pagoda.engine_core.protocol import TokenLogprobs
from pagoda.engine_core.request import Request
from pagoda.kernels import ops

_NEG_INF = float("-inf")


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors, built once per step from the requests that sample."""

    requests: list[Request]
    temperature: torch.Tensor  # [B]; 0 = greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [B]
    min_p: torch.Tensor | None  # [B]
    penalized: bool
    biased: bool  # some request has a logit_bias
    max_logprobs: int  # largest `logprobs` asked for, -1 if none
    grammars: dict[int, RequestGrammar]  # row -> the grammar to mask it by (structured output)

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int) -> SamplingBatch:
        params = [r.params for r in requests]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        all_greedy = all(p.temperature == 0.0 for p in params)
        top_k = top_p = min_p = None
        if not all_greedy:
            if any(p.top_k > 0 for p in params):
                top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params])
            if any(p.top_p < 1.0 for p in params):
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
            if any(p.min_p > 0.0 for p in params):
                min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            requests,
            temperature,
            all_greedy,
            top_k,
            top_p,
            min_p,
            penalized=any(p.uses_penalties for p in params),
            biased=any(p.logit_bias for p in params),
            max_logprobs=max(logprobs) if logprobs else -1,
            grammars={row: r.grammar for row, r in enumerate(requests) if r.grammar is not None},
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]  # per row (0 for a failed row)
    logprobs: list[TokenLogprobs | None]  # per row; None when the request did not ask for them
    failed_rows: list[int]  # rows whose logits were not finite: their token is no token


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition (prompt + output tokens), presence and frequency (output tokens) penalties."""
    batch, vocab = logits.shape
    device = logits.device
    out_counts = torch.zeros(batch, vocab, dtype=torch.float32, device=device)
    seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
    for row, request in enumerate(requests):  # builds index tensors only; the math below is batched
        if not request.params.uses_penalties:
            continue
        outputs = torch.tensor(request.output_token_ids, dtype=torch.int64, device=device)
        if outputs.numel():
            out_counts[row].index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.float32))
        prompt = torch.tensor(request.prompt_token_ids, dtype=torch.int64, device=device)
        seen[row, prompt] = True
    seen |= out_counts > 0
    rep = torch.tensor([r.params.repetition_penalty for r in requests], device=device)[:, None]
    presence = torch.tensor([r.params.presence_penalty for r in requests], device=device)[:, None]
    frequency = torch.tensor([r.params.frequency_penalty for r in requests], device=device)[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency * out_counts - presence * (out_counts > 0).float()
    return logits


def apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """OpenAI's logit_bias: a per-request value added to chosen tokens' logits."""
    rows, cols, values = [], [], []
    for row, request in enumerate(requests):
        for token_id, bias in request.params.logit_bias.items():
            rows.append(row)
            cols.append(token_id)
            values.append(bias)
    if not rows:
        return logits
    logits = logits.clone()  # never write into the raw logits that logprobs are computed from
    logits[rows, cols] += torch.tensor(values, dtype=logits.dtype, device=logits.device)
    return logits


def mask_min_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Forbid EOS and stop tokens while a request has produced fewer than min_tokens (not for
    structured output: its grammar decides when the output may end)."""
    rows: list[int] = []
    cols: list[int] = []
    for row, request in enumerate(requests):
        if request.num_output_tokens < request.params.min_tokens and request.grammar is None:
            banned = set(request.stop_token_ids)
            if not request.params.ignore_eos:
                banned |= request.eos_token_ids
            rows.extend([row] * len(banned))
            cols.extend(banned)
    if rows:
        logits = logits.clone()  # never write into the raw logits that logprobs are computed from
        logits[rows, cols] = _NEG_INF
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * batch.min_p.to(logits.device)[:, None]
        logits = logits.masked_fill(probs < threshold, _NEG_INF)
    if batch.top_k is None and batch.top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if batch.top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= batch.top_k.to(logits.device)[:, None], _NEG_INF)
    if batch.top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
        beyond = mass_before >= batch.top_p.to(logits.device)[:, None]
        beyond[:, 0] = False  # the best token always stays (a top_p that rounds to 0 in float32 masked it)
        sorted_logits = sorted_logits.masked_fill(beyond, _NEG_INF)
    return torch.full_like(logits, _NEG_INF).scatter_(-1, order, sorted_logits)


def _draw(probs: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `probs` [B, V] (each row's weights need not sum to 1): the first whose
    cumulative weight exceeds u * total, u ~ U[0, 1) from the request's own generator if it has a seed.
    Strictly exceeds: a zero-weight token can never be the one. Also: which rows had a distribution
    (a positive, finite total; a row of NaN weights draws an index past the vocabulary)."""
    uniforms = torch.rand(len(batch.requests))
    for row, request in enumerate(batch.requests):
        if request.generator is not None and request.params.temperature > 0:
            uniforms[row] = torch.rand((), generator=request.generator)
    cumulative = probs.cumsum(dim=-1)
    total = cumulative[:, -1:]
    targets = torch.minimum(uniforms.to(probs.device)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    drawable = (torch.isfinite(total) & (total > 0)).squeeze(1)
    return torch.searchsorted(cumulative, targets, right=True).squeeze(1), drawable


def _greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (torch's rule; compiled on the CPU: kernels/cpu/argmax.c), and whether the
    row was finite: its chosen logit is NaN if any is, +inf if any is, -inf if every token is masked."""
    tokens = ops.argmax_rows(logits)
    return tokens, torch.isfinite(logits.gather(-1, tokens[:, None]).squeeze(1))


def gather_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch):
    """Per row, the sampled token's logprob and the top-N, packed (column 0 = the sampled token)."""
    logprobs = torch.log_softmax(raw_logits, dim=-1)
    sampled = logprobs.gather(-1, token_ids[:, None])
    k = max(batch.max_logprobs, 0)
    top_vals, top_ids = logprobs.topk(k, dim=-1)
    ids = torch.cat([token_ids[:, None], top_ids], dim=1).to(torch.int32).cpu().numpy()
    values = torch.cat([sampled, top_vals], dim=1).float().cpu().numpy()
    return [
        None
        if r.params.logprobs is None
        else TokenLogprobs.pack(ids[row, : 1 + r.params.logprobs], values[row, : 1 + r.params.logprobs])
        for row, r in enumerate(batch.requests)
    ]


def process_logits(logits: torch.Tensor, batch: SamplingBatch, keep_raw: bool = True) -> torch.Tensor:
    """The logit processors: penalties, logit_bias, min_tokens and grammar masks. With `keep_raw` the
    raw logits (what logprobs are computed from) are left as they are; without, the grammar mask may be
    applied to them in place (no copy of the batch's logits)."""
    raw_logits = logits
    if batch.penalized:
        logits = apply_penalties(logits, batch.requests)
    if batch.biased:
        logits = apply_logit_bias(logits, batch.requests)
    logits = mask_min_tokens(logits, batch.requests)
    if batch.grammars:  # last of the logit processors, so nothing can revive a masked token
        if logits is raw_logits and keep_raw:
            logits = logits.clone()  # the mask works in place
        apply_grammar_bitmask(logits, batch.grammars)
    return logits


def distributions(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] float32: the distribution `sample` draws each row from (temperature 0: a point mass on the
    processed argmax). Speculative decoding's rejection sampling needs them whole (speculative/verify.py).
    A row whose logits are not finite comes back with NaN in it, as softmax gives it, greedy or not."""
    logits = process_logits(logits, batch)
    temperature = batch.temperature.to(logits.device)
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    probs = torch.softmax(apply_top_k_top_p_min_p(scaled, batch), dim=-1)
    tokens, finite = _greedy(logits)
    greedy = torch.zeros_like(probs).scatter_(-1, tokens[:, None], 1.0)
    greedy[~finite] = float("nan")
    return torch.where((temperature > 0)[:, None], probs, greedy)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """One token per row of `logits` [B, V] (float32), for the rows in `batch.requests`, in that order."""
    raw_logits = logits
    logits = process_logits(logits, batch, keep_raw=batch.max_logprobs >= 0)
    if batch.all_greedy:
        tokens, finite = _greedy(logits)
    else:
        temperature = batch.temperature.to(logits.device)
        scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
        scaled = apply_top_k_top_p_min_p(scaled, batch)
        tokens, finite = _draw(torch.softmax(scaled, dim=-1), batch)
        if any(r.params.temperature == 0.0 for r in batch.requests):  # (no greedy argmax when none asks)
            greedy_tokens, greedy_finite = _greedy(logits)
            sampled = temperature > 0
            tokens = torch.where(sampled, tokens, greedy_tokens)
            finite = torch.where(sampled, finite, greedy_finite)
    failed_rows: list[int] = []
    if not bool(finite.all()):
        failed_rows = (~finite).nonzero().flatten().tolist()
        tokens = torch.where(finite, tokens, 0)  # (an index past the vocabulary must not reach the gather)
    logprobs = gather_logprobs(raw_logits, tokens, batch) if batch.max_logprobs >= 0 else [None] * len(batch.requests)
    return SamplerOutput(tokens.tolist(), logprobs, failed_rows)
