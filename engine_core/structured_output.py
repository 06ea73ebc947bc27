"""Structured output in the engine: grammars compiled off the hot loop, one matcher per request, and
one batched token bitmask per step (xgrammar on the CPU).

How a constrained request flows:
1. `EngineCore.add_request` hands it to `StructuredOutputManager.submit`, which refuses a spec over the
   size limits (ParamError). It waits there, outside the scheduler, while a compile worker compiles
   its grammar (or finds it in the cache); aborting it cancels a compile nobody else waits for.
2. `collect()` (each step) attaches a `RequestGrammar` to requests whose grammar is ready, and returns
   those whose spec failed or ran past the compile time limit; the engine rejects them
   (RequestRejected -> a 400), before any compute.
3. The sampler calls `apply_grammar_bitmask` (engine_core/grammar_backend.py) for the rows with a grammar:
   one batch fill of the bitmask, one in-place apply on the logits. Rows without a grammar pay nothing.
4. `Request.append_token` advances the matcher with every token the request keeps; a terminated
   matcher ends the request ("stop").

Why here, and why worker processes: xgrammar and the tokenizer it needs import torch and
transformers, which the API and tokenizer processes are kept free of; the engine has them anyway. The
compiles run in a small pool of worker processes (engine_core/grammar_pool.py: several at once,
smallest spec first, each under a time limit, killed when every request waiting for it has gone),
because an xgrammar compile cannot be interrupted and a runaway one must not keep the engine's CPU
and memory. Oversized specs are refused before any compile (engine_core/structured_limits.py). One
compile per spec serves every request that uses it; nothing is compiled twice. Typical schemas
compile in 5-70 ms on 2 cores.

Whitespace: JSON grammars are compiled with `any_whitespace=False`: separators are exactly ", " and
": ", no newlines or indentation, so a sampled output cannot run away in whitespace and ends the
moment its value is complete (only EOS is then allowed). Objects get only their declared properties
(xgrammar's strict mode) in the schema's order.

Preemption is by recompute and keeps the request's tokens, so the matcher, advanced with exactly the
tokens kept, needs no rollback; finishing or aborting a request drops its matcher.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, InvalidStateError, wait
from pathlib import Path
from typing import TYPE_CHECKING

from pagoda.engine_core.grammar_backend import GrammarBackend, GrammarError, RequestGrammar
from pagoda.engine_core.grammar_pool import LOAD_NICENESS, CompileNotDone, GrammarCompilePool
from pagoda.engine_core.grammar_worker import SpecError, choice_grammar
from pagoda.engine_core.structured_limits import StructuredOutputLimits

if TYPE_CHECKING:
    from pagoda.engine_core.request import Request

logger = logging.getLogger(__name__)
__all__ = ["LOAD_NICENESS", "GrammarBackend", "GrammarError", "StructuredOutputManager", "choice_grammar"]


class StructuredOutputManager:
    """Holds the requests waiting for their grammar, compiles each spec once in a pool of worker
    processes (engine_core/grammar_pool.py), and caches the outcome by (kind, spec), refusals
    included. Everything but the compile and the backend's load runs on the engine thread.

    `limits`: the largest spec accepted (`submit` raises ParamError above them); `compile_timeout`:
    seconds one compile may run (None: no limit); `num_workers`: compiles at once."""

    def __init__(
        self,
        model_dir: str | Path,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        cache_size: int = 256,
        limits: StructuredOutputLimits | None = None,
        compile_timeout: float | None = 10.0,
        num_workers: int = 2,
    ):
        self._backend_args = (model_dir, vocab_size, eos_token_ids)
        self._backend: Future | None = None
        self._backend_lock = threading.Lock()  # one load at normal priority at a time (`_load_backend`)
        self.limits = limits or StructuredOutputLimits()
        self.pool = GrammarCompilePool(self._load_backend, num_workers, compile_timeout)
        weakref.finalize(self, self.pool.close)  # (an engine collected without `close`)
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()  # done futures, LRU order
        self._cache_size = cache_size
        self._compiling: dict[tuple[str, str], Future] = {}
        self._pending: dict[str, tuple[Request, Future]] = {}
        self.loader: threading.Thread | None = None  # the low-priority start-up load (`start`)
        self.load_niceness: int | None = None  # the niceness it ran at

    @property
    def num_compiles(self) -> int:
        """Grammars compiled (not served from the cache), for tests and stats."""
        return self.pool.num_compiles

    def start(self, after: Callable[[], object] | None = None) -> None:
        """Begin loading the backend now (xgrammar, tokenizer: 2.6-3 s of CPU, most of it the tokenizer's
        first load), then start the compile workers, so the first constrained request waits for
        neither. The server calls this once it is ready. The load runs in a thread of its own at the
        lowest CPU priority, and the workers import at it too: at full priority the load took a core
        from the engine's threads, and requests sent in the server's first seconds ran several times
        slower (one 512-token prompt's first token: 1.6 s instead of 0.33 s). A compile that needs the
        backend before that thread has it loads one itself, at the normal priority (`_load_backend`),
        rather than wait on a thread the engine may starve. `after`: what the thread waits for first
        (the KV pool's pages, which every request needs: engine_core/kv_prefault.py)."""
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
        if not self._backend.done():  # (else a compile needed it first and loaded it: `_load_backend`)
            try:
                backend = GrammarBackend(*self._backend_args)
            except Exception as exc:  # noqa: BLE001 - any failure goes to the future, and to each compile
                with contextlib.suppress(InvalidStateError):
                    self._backend.set_exception(exc)
                return
            with contextlib.suppress(InvalidStateError):  # (a compile may have loaded one first)
                self._backend.set_result(backend)
        self.pool.prestart()

    def backend(self) -> GrammarBackend:
        """The loaded backend, loading it here if need be (tests, benchmarks)."""
        return self._load_backend()

    def _load_backend(self) -> GrammarBackend:
        """The backend; loaded in this thread, at its priority, unless it is loaded already."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = Future()
            if not self._backend.done():  # not started, or still loading at low priority (`start`)
                with contextlib.suppress(InvalidStateError):
                    self._backend.set_result(GrammarBackend(*self._backend_args))
        return self._backend.result()

    def close(self) -> None:
        """Stop the compile workers (the engine cannot compile afterwards)."""
        self.pool.close()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def has_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def submit(self, request: Request) -> None:
        """Park `request`, which has structured output, until its grammar is compiled; `collect` hands
        it back. Raises ParamError (nothing parked) if its spec is over this server's limits."""
        params = request.params.structured_outputs
        if params is None:
            raise ValueError(f"request {request.request_id!r} has no structured output to compile")
        self.limits.check(params)
        key = params.cache_key()
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
        else:
            future = self._compiling.get(key)
        if future is None:
            future = self._compiling[key] = self.pool.submit(key)
        self._pending[request.request_id] = (request, future)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting request; a compile no other request waits for is cancelled (its worker
        killed if it is compiling), so a client that leaves frees what it asked for."""
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return False
        future = entry[1]
        if not future.done() and all(other is not future for _, other in self._pending.values()):
            self.pool.cancel(future)
            key = next((k for k, f in self._compiling.items() if f is future), None)
            if key is not None:
                del self._compiling[key]
        return True

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
                if isinstance(future.exception(), CompileNotDone):
                    continue  # (timed out or lost: the same spec may compile another time)
                self._cache[key] = future
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        ready, refused = [], []
        for request_id, (request, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            error = future.exception()
            source = request.params.structured_outputs.source if request.params.structured_outputs else ""
            if error is None:
                request.grammar = RequestGrammar(self.backend(), future.result())  # (loaded by now)
                ready.append(request)
            elif isinstance(error, SpecError):
                refused.append((request, f"Invalid '{source}': {error}"))
            else:  # the backend itself failed (e.g. xgrammar missing): this request fails, not the engine
                logger.error("structured output backend failed: %r", error)
                refused.append((request, f"Structured output is unavailable on this server: {error}"))
        return ready, refused
