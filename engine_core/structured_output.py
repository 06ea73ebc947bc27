"""Structured output in the engine: grammars compiled off the hot loop, one matcher per request, and
one batched token bitmask per step (xgrammar on the CPU).

How a constrained request flows:
1. `EngineCore.add_request` hands it to `StructuredOutputManager.submit`. It waits there, outside the
   scheduler, while the worker thread compiles its grammar (or finds it in the cache).
2. `collect()` (each step) attaches a `RequestGrammar` to requests whose grammar is ready, and returns
   those whose spec failed; the engine rejects them (RequestRejected -> a 400), before any compute.
3. The sampler calls `apply_grammar_bitmask` for the rows with a grammar: one batch fill of the
   bitmask, one in-place apply on the logits. Rows without a grammar pay nothing.
4. `Request.append_token` advances the matcher with every token the request keeps; a terminated
   matcher ends the request ("stop").

Why here, and why a thread: xgrammar and the tokenizer it needs import torch and transformers, which
the API and tokenizer processes are kept free of; the engine has them anyway. Compilation releases the
GIL (measured: the engine thread kept its full speed during a 90 ms compile), so a slow schema never
stalls other requests' steps. One compile per schema serves every request that uses it; nothing is
compiled twice or shipped between processes. Typical schemas compile in 5-70 ms on 2 cores.

Whitespace: JSON grammars are compiled with `any_whitespace=False`: separators are exactly ", " and
": ", no newlines or indentation, so a sampled output cannot run away in whitespace and ends the
moment its value is complete (only EOS is then allowed). Objects get only their declared properties
(xgrammar's strict mode) in the schema's order.

Preemption is by recompute and keeps the request's tokens, so the matcher, advanced with exactly the
tokens kept, needs no rollback; finishing or aborting a request drops its matcher.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, InvalidStateError, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING

from engine_core.json_schema_support import unsupported_feature
from engine_core.structured_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

    from engine_core.request import Request

logger = logging.getLogger(__name__)
LOAD_NICENESS = 19  # the backend's start-up load takes only what the engine leaves (see `start`)
_XGRAMMAR_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")  # "[12:00:00] /project/cpp/x.cc:94: "
_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


class GrammarError(ValueError):
    """A spec the backend cannot compile or would not enforce; the message is fit for a 400."""


class GrammarBackend:
    """xgrammar for one model: its tokenizer's vocabulary and a compiler. Built in the worker thread."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: frozenset[int]):
        import xgrammar as xgr

        from engine_core.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
        # The logits may be wider than the tokenizer's vocabulary (padded embeddings): the mask must
        # cover every logit, and ids the tokenizer lacks are never allowed.
        self.vocab_size = max(vocab_size, len(tokenizer))
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=sorted(eos_token_ids) or None
        )
        # Half the cores at most: compilation shares the machine with the engine's own threads.
        threads = max(1, (os.cpu_count() or 2) // 2)
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.batch_matcher = xgr.BatchGrammarMatcher(threads)
        self.xgr = xgr

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar for `params`, or GrammarError naming what is wrong with it."""
        kind, spec = params.cache_key()
        if kind == "json":
            problem = unsupported_feature(json.loads(spec))
            if problem:
                raise GrammarError(
                    f"Invalid '{params.source}': the JSON schema uses {problem}, which "
                    "structured output cannot enforce."
                )
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(json.loads(spec)))
            return self.compiler.compile_grammar(spec)
        except Exception as exc:  # noqa: BLE001 - xgrammar reports every bad spec as some exception
            message = _XGRAMMAR_LOCATION.sub("", str(exc)).strip()
            raise GrammarError(
                f"Invalid '{params.source}': the {_KIND_NAMES[kind]} cannot be compiled: {message}"
            ) from None

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)


def choice_grammar(choices: list[str]) -> str:
    """EBNF for "exactly one of these strings". JSON string escapes are the EBNF's; non-ASCII text
    stays literal (xgrammar reads \\u escapes of surrogate pairs as two characters)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


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


class StructuredOutputManager:
    """Compiles grammars in one worker thread (cached by (kind, spec), errors included) and holds the
    requests waiting for theirs. Everything but the compile itself runs on the engine thread."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: frozenset[int], cache_size: int = 256):
        self._backend_args = (model_dir, vocab_size, eos_token_ids)
        # Its one thread starts with the first job (the backend load: `start` or the first submit).
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-grammar")
        self._backend: Future | None = None
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()  # done futures, LRU order
        self._cache_size = cache_size
        self._compiling: dict[tuple[str, str], Future] = {}
        self._pending: dict[str, tuple[Request, Future]] = {}
        self.num_compiles = 0  # grammars compiled (not served from the cache), for tests and stats
        self.loader: threading.Thread | None = None  # the low-priority start-up load (`start`)
        self.load_niceness: int | None = None  # the niceness it ran at

    def start(self, after: Callable[[], object] | None = None) -> None:
        """Begin loading the backend now (xgrammar, tokenizer: 2.6-3 s of CPU, most of it the tokenizer's
        first load), so the first constrained request does not wait for it. The server calls this once
        it is ready. The load runs in a thread of its own at the lowest CPU priority: at full priority
        it took a core from the engine's threads, and requests sent in the server's first seconds ran
        several times slower (one 512-token prompt's first token: 1.6 s instead of 0.33 s). A grammar
        compile that needs the backend before that thread has it loads one itself, at the normal
        priority (`_compile`), rather than wait on a thread the engine may starve. `after`: what the
        thread waits for first (the KV pool's pages, which every request needs: engine_core/kv_prefault.py)."""
        if self._backend is None:
            self._backend = Future()
            self.loader = threading.Thread(
                target=self._load_in_background, args=(after,), name="pagoda-grammar-load", daemon=True
            )
            self.loader.start()

    def _load_in_background(self, after: Callable[[], object] | None) -> None:
        with contextlib.suppress(OSError):  # (lowering one's own priority is always allowed on Linux)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOAD_NICENESS)
        self.load_niceness = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # (for tests)
        if after is not None:
            after()
        assert self._backend is not None
        if self._backend.done():  # a compile needed it first and loaded it (`_compile`)
            return
        try:
            backend = GrammarBackend(*self._backend_args)
        except Exception as exc:  # noqa: BLE001 - any failure goes to the future, as an executor job's would
            with contextlib.suppress(InvalidStateError):
                self._backend.set_exception(exc)
            return
        with contextlib.suppress(InvalidStateError):  # (a compile may have loaded one first)
            self._backend.set_result(backend)

    def backend(self) -> GrammarBackend:
        """The loaded backend, waiting for it if need be (tests, benchmarks)."""
        return self._backend_future().result()

    def _backend_future(self) -> Future:
        if self._backend is None:
            self._backend = self._executor.submit(GrammarBackend, *self._backend_args)
        return self._backend

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def has_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def submit(self, request: Request) -> None:
        """Park `request`, which has structured output, until its grammar is compiled; `collect` hands
        it back."""
        params = request.params.structured_outputs
        if params is None:
            raise ValueError(f"request {request.request_id!r} has no structured output to compile")
        key = params.cache_key()
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
        else:
            future = self._compiling.get(key)
        if future is None:
            backend = self._backend_future()
            future = self._compiling[key] = self._executor.submit(self._compile, backend, params)
        self._pending[request.request_id] = (request, future)

    def _compile(self, backend: Future, params: StructuredOutputsParams):  # in the worker thread
        if not backend.done():  # still loading at low priority (`start`): load one here, at ours
            with contextlib.suppress(InvalidStateError):
                backend.set_result(GrammarBackend(*self._backend_args))
        compiled = backend.result().compile(params)
        self.num_compiles += 1
        return compiled

    def abort(self, request_id: str) -> bool:
        return self._pending.pop(request_id, None) is not None

    def wait(self, timeout: float) -> None:
        """Block until some pending grammar is ready or `timeout` passes (for an engine with nothing
        else to do, instead of spinning)."""
        if self._pending:
            wait({future for _, future in self._pending.values()}, timeout, FIRST_COMPLETED)

    def collect(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """(requests now ready to schedule, with their grammar attached; requests refused, with why)."""
        for key, future in list(self._compiling.items()):
            if future.done():
                del self._compiling[key]
                self._cache[key] = future
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        ready, refused = [], []
        for request_id, (request, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            error = future.exception()
            if error is None:
                request.grammar = RequestGrammar(self.backend(), future.result())  # (loaded by now)
                ready.append(request)
            elif isinstance(error, GrammarError):
                refused.append((request, str(error)))
            else:  # the backend itself failed (e.g. xgrammar missing): this request fails, not the engine
                logger.error("structured output backend failed: %r", error)
                refused.append((request, f"Structured output is unavailable on this server: {error}"))
        return ready, refused


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
