"""Prompts to token ids for the tokenizer process's poll loop, which must never be blocked for long.

A prompt too long to fit is refused from its length (prompt_size.py). Short prompts are tokenized
inline, where a thread hop would cost more than the work. Long ones go to the background thread
(background.py), within a budget of queued text: past it, clients get a 429 rather than a queue of
seconds. The loop collects finished work with `finished()` when `fileno()` turns readable, and a
request aborted meanwhile is dropped (not started, or its result thrown away).

`handed_bytes` counts the text handed to the tokenizer, inline and in the background (what
/metrics exports as pagoda:tokenizer_bytes): a prompt refused from its length never counts, so tests
and operators can see that it was never tokenized.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from pagoda.detok_proc.background import BackgroundWork
from pagoda.detok_proc.prompt_size import PromptTooLong, check_length_bound, longest_token_bytes, prompt_bytes
from pagoda.detok_proc.requests import RequestInvalid, prompt_token_ids
from pagoda.engine_core import protocol

Key = tuple[bytes, str]  # (client identity, the client's request id)
# Texts longer than this (bytes; ~4 per token id when decoding) go to the background thread: ~20 ms of
# tokenizer time, about what one engine step takes.
BACKGROUND_BYTES = 32_768
QUEUE_BYTES = 4 * 1024 * 1024  # queued for the background thread at most: a few seconds of tokenizing


@dataclass
class _Pending:
    job: int
    size: int
    then: Callable[[object], None]


class PromptTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.max_token_bytes = longest_token_bytes(tokenizer)
        self.background = BackgroundWork()
        self.queued_bytes = 0
        self.handed_bytes = {"inline": 0, "background": 0}  # text handed to the tokenizer, by where it ran
        self._pending: dict[Key, _Pending] = {}
        self._by_job: dict[int, Key] = {}
        self._jobs = itertools.count()

    def fileno(self) -> int:
        return self.background.fileno()

    def is_pending(self, key: Key) -> bool:
        return key in self._pending

    def pending_keys(self) -> list[Key]:
        return list(self._pending)

    def tokenize(
        self,
        key: Key,
        request: protocol.PromptRequest,
        vocab_size: int,
        token_limit: int,
        then: Callable,
        post: Callable[[list[int]], object] | None = None,
    ) -> None:
        """`then(ids)` (or `then(post(ids))`, `post` running where the tokenizing ran) once the prompt
        is tokenized; RequestInvalid now if it is refused before any tokenizing."""
        size = prompt_bytes(request)
        try:
            check_length_bound(size, token_limit, self.max_token_bytes)
        except PromptTooLong as exc:
            param = "messages" if request.messages is not None else "prompt"
            raise RequestInvalid(str(exc), param, "context_length_exceeded") from None

        def work() -> object:
            ids = prompt_token_ids(self.tokenizer, request, vocab_size, token_limit)
            return ids if post is None else post(ids)

        self.run(key, size, work, then)

    def run(self, key: Key, size: int, work: Callable[[], object], then: Callable) -> None:
        """`then(work())`: now if `size` is small, else after the background thread has run `work`."""
        if size <= BACKGROUND_BYTES:
            self.handed_bytes["inline"] += size
            then(work())
            return
        if key in self._pending:
            raise RequestInvalid(f"request id {key[1]!r} is already in use", "request_id")
        if self.queued_bytes + size > QUEUE_BYTES:
            raise RequestInvalid(
                "The server is busy tokenizing other long prompts; retry shortly.",
                status=429,
                code="too_many_requests",
                error_type="rate_limit_error",
            )
        job = next(self._jobs)
        self._pending[key] = _Pending(job, size, then)
        self._by_job[job] = key
        self.queued_bytes += size
        self.handed_bytes["background"] += size
        self.background.submit(job, work)

    def cancel(self, key: Key) -> bool:
        """Drop the pending work of `key` (its result, if it is running, is thrown away)."""
        pending = self._pending.pop(key, None)
        if pending is None:
            return False
        self._forget(pending)
        self.background.cancel(pending.job)
        return True

    def finished(self) -> list[tuple[Key, Callable, object, BaseException | None]]:
        """(key, then, result, error) of the work finished since the last call (cancelled work left out)."""
        out = []
        for job, result, error in self.background.finished():
            key = self._by_job.get(job)
            if key is None:
                continue
            pending = self._pending.pop(key)
            self._forget(pending)
            out.append((key, pending.then, result, error))
        return out

    def _forget(self, pending: _Pending) -> None:
        self._by_job.pop(pending.job, None)
        self.queued_bytes -= pending.size

    def close(self) -> None:
        self.background.close()
