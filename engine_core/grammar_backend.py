"""xgrammar in the engine: the backend for one model (`GrammarBackend`), one request's matcher
(`RequestGrammar`), and the step's token bitmask (`apply_grammar_bitmask`). The manager that compiles grammars
and attaches them to requests is engine_core/structured_output.py; the compile workers are
engine_core/grammar_pool.py."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pagoda.engine_core.grammar_worker import SpecError, compile_spec
from pagoda.engine_core.structured_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class GrammarError(ValueError):
    """A spec the backend cannot compile or would not enforce; the message is fit for a 400."""


class GrammarBackend:
    """xgrammar for one model: its tokenizer's vocabulary (`info`, and as JSON for the compile
    workers) and the batch matcher. Built off the engine thread (`StructuredOutputManager.start`)."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: frozenset[int]):
        import xgrammar as xgr

        from pagoda.engine_core.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
        # The logits may be wider than the tokenizer's vocabulary (padded embeddings): the mask must
        # cover every logit, and ids the tokenizer lacks are never allowed.
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=sorted(eos_token_ids) or None
        )
        self.info_json = self.info.serialize_json()
        # Half the cores at most: mask filling shares the machine with the engine's own threads.
        self.batch_matcher = xgr.BatchGrammarMatcher(max(1, (os.cpu_count() or 2) // 2))
        self.xgr = xgr

    @functools.cached_property
    def compiler(self):
        """An xgrammar compiler in this process, for tests and benchmarks; serving compiles in the
        worker processes (engine_core/grammar_pool.py)."""
        return self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar for `params`, compiled here (tests, benchmarks), or GrammarError."""
        try:
            return compile_spec(self.compiler, *params.cache_key())
        except SpecError as exc:
            raise GrammarError(f"Invalid '{params.source}': {exc}") from None

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)


class RequestGrammar:
    """One request's matcher, advanced with each token the request keeps (`Request.append_token`)."""

    __slots__ = ("backend", "matcher", "refused")

    def __init__(self, backend: GrammarBackend, compiled):
        self.backend = backend
        self.matcher = backend.matcher(compiled)
        self.refused = False

    def accept(self, token_id: int) -> None:
        # Sampling under the mask only picks allowed tokens; a refusal is a bug. It ends the request
        # (see `finished`) instead of the engine, and is logged loudly.
        if not self.matcher.accept_token(token_id):
            self.refused = True
            logger.error("grammar refused sampled token %d; ending the request", token_id)

    @property
    def finished(self) -> bool:
        """The output is complete (the matcher took its stop token) or can no longer be completed."""
        return self.refused or self.matcher.is_terminated()


def apply_grammar_bitmask(logits: torch.Tensor, grammars: dict[int, RequestGrammar]) -> None:
    """Mask, in place, every token that would break the grammar of row `i` of the logits, for each
    `i: grammar` in `grammars`: one batched fill of the bitmask (xgrammar's C++ threads) and one
    vectorized apply."""
    import torch

    rows = list(grammars)
    backend = grammars[rows[0]].backend
    width = (backend.vocab_size + 31) // 32
    bitmask = torch.empty((logits.shape[0], width), dtype=torch.int32)  # rows outside `rows` unused
    backend.batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars.values()], bitmask, indices=rows)
    backend.xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), vocab_size=logits.shape[-1], indices=rows
    )
