"""One log line per finished HTTP generation request: id, endpoint, status, prompt / completion /
cached tokens, time to first token, latency, finish reasons — and the prompt itself only when the
server runs with `--log-requests` (prompts are users' data).

`with logged(record):` wraps a generation handler from its first line and writes the line when the
handler ends, however it ends: answered (200, or the status of an error met mid-stream), refused
(its 4xx, from body parsing onward), failed (500), or cancelled by a client that went away (499,
nginx's "client closed request"). `observed(deltas, record)` counts tokens as the deltas pass."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field

from pagoda.api_proc.client import EngineError
from pagoda.api_proc.metrics import count_aborted
from pagoda.api_proc.openai_schema import ApiError
from pagoda.engine_core.protocol import FinishReason, GenerateDelta

logger = logging.getLogger("pagoda.requests")
CLIENT_CLOSED = 499


@dataclass
class RequestRecord:
    request_id: str
    endpoint: str
    prompt: object | None = None  # logged only with --log-requests
    status: int | None = None  # None until known; an error met mid-stream sets its own
    started: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    prompt_tokens: dict[int, int] = field(default_factory=dict)  # per prompt
    cached_tokens: dict[int, int] = field(default_factory=dict)  # per prompt (its first sample)
    output_tokens: dict[tuple[int, int], int] = field(default_factory=dict)  # per (prompt, sample)
    finish_reasons: Counter[FinishReason] = field(default_factory=Counter)
    request: object | None = None  # the parsed body, once parsed (the trace's gen_ai.request.* attributes)
    trace_context: str | None = None  # the W3C traceparent of its span, when traced (api_proc/request_trace.py)

    def observe(self, prompt_index: int, delta: GenerateDelta) -> None:
        if self.first_token is None and delta.num_output_tokens:
            self.first_token = time.monotonic()
        self.prompt_tokens[prompt_index] = delta.num_prompt_tokens
        if delta.index == 0:
            self.cached_tokens[prompt_index] = delta.num_cached_tokens
        self.output_tokens[(prompt_index, delta.index)] = delta.num_output_tokens
        if delta.finish_reason is not None:
            self.finish_reasons[delta.finish_reason] += 1

    def fields(self) -> dict:
        now = time.monotonic()
        fields = {
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "status": self.status,
            "prompt_tokens": sum(self.prompt_tokens.values()),
            "completion_tokens": sum(self.output_tokens.values()),
            "cached_tokens": sum(self.cached_tokens.values()),
            "ttft_ms": None if self.first_token is None else round((self.first_token - self.started) * 1e3, 1),
            "latency_ms": round((now - self.started) * 1e3, 1),
            "finish_reason": ",".join(sorted(reason.value for reason in self.finish_reasons)) or None,
        }
        if self.prompt is not None:
            fields["prompt"] = self.prompt
        return fields

    def emit(self) -> None:
        level = logging.WARNING if self.status >= 500 else logging.INFO
        logger.log(level, "request finished", extra={"fields": self.fields()})


@contextmanager
def logged(record: RequestRecord):
    """Log `record` once when the block ends, with the status the request ended with."""
    try:
        yield record
    except (ApiError, EngineError) as exc:
        record.status = exc.status
        raise
    except OverflowError:  # a number too large to cross to the engine: the error middleware answers 400
        record.status = 400
        raise
    except asyncio.CancelledError:  # the client went away; aiohttp cancels its handler
        record.status = CLIENT_CLOSED
        raise
    except Exception:  # a bug: the error middleware answers 500
        record.status = 500
        raise
    else:
        if record.status is None:
            record.status = 200
    finally:
        if record.status is None:
            record.status = CLIENT_CLOSED
        if record.status == CLIENT_CLOSED:
            count_aborted()
        record.emit()


async def observed(deltas, record: RequestRecord):
    """Yield `deltas` unchanged, recording their token counts, and the status of an error passing
    through (a stream answers it as an error event after its 200 status line has gone out)."""
    async with aclosing(deltas):  # closed with us, at once: that is what aborts the request
        try:
            async for prompt_index, delta in deltas:
                record.observe(prompt_index, delta)
                yield prompt_index, delta
        except (ApiError, EngineError) as exc:
            record.status = exc.status
            raise
