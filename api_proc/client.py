"""Direct clients of the frontend socket: `AsyncEngineClient` (asyncio) and `EngineClient` (blocking).

Internal services skip HTTP and JSON: connect a DEALER socket to the server's frontend address (the
`ipc://` path `pagoda serve` prints, or `tcp://` with CURVE keys), send a request and iterate over its
deltas. The HTTP api_proc is itself an `AsyncEngineClient`, so both paths share every check.

    client = EngineClient("ipc:///run/user/1000/pagoda-1234/frontend.sock")
    for delta in client.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0)):
        print(delta.text, end="", flush=True)

A server serving an embedding model answers `embed` instead (`client.embed(["a", "b"]).embeddings()`).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import uuid
import weakref
from collections.abc import AsyncGenerator, Iterator

import zmq
import zmq.asyncio

from pagoda.engine_core import protocol
from pagoda.engine_core.pooling.params import PoolingParams
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.zmq_security import connect_curve


class EngineError(Exception):
    """The server refused or failed a request; fields as in OpenAI's error envelope."""

    def __init__(self, error: protocol.RequestError):
        super().__init__(error.message)
        self.status, self.message, self.type = error.status, error.message, error.error_type
        self.param, self.code = error.param, error.code


def build_request(
    request_id: str,
    prompt: str | None,
    messages: list[dict] | None,
    prompt_token_ids: list[int] | None,
    params: SamplingParams | None,
    stop,
    **options,
) -> protocol.GenerateRequest:
    if sum(x is not None for x in (prompt, messages, prompt_token_ids)) != 1:
        raise ValueError("give exactly one of prompt, messages or prompt_token_ids")
    chat_options = {
        k: options.pop(k)
        for k in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")
        if k in options
    }
    return protocol.GenerateRequest(
        request_id=request_id,
        params=params or SamplingParams(),
        prompt=prompt,
        messages=messages,
        prompt_tokens=None if prompt_token_ids is None else protocol.pack_tokens(prompt_token_ids),
        chat=protocol.ChatOptions(**chat_options) if messages is not None else None,
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        **options,
    )


EmbedInput = str | list[str] | list[int] | list[list[int]]


def build_embed_request(
    request_id: str,
    inputs: EmbedInput,
    dimensions: int | None = None,
    task: str = "embed",
    normalize: bool | None = None,
    truncate_prompt_tokens: int | None = None,
    add_special_tokens: bool = True,
) -> protocol.EmbedRequest:
    """One text, a list of texts, one input's token ids or a list of them, as OpenAI's `input` takes them;
    ValueError for anything else."""
    texts, token_ids = None, None
    if isinstance(inputs, str):
        texts = [inputs]
    elif isinstance(inputs, list) and all(isinstance(x, str) for x in inputs):
        texts = list(inputs)  # (an empty list too: the server names the field)
    elif isinstance(inputs, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in inputs):
        token_ids = [protocol.pack_tokens(inputs)]
    elif isinstance(inputs, list) and all(
        isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x) for x in inputs
    ):
        token_ids = [protocol.pack_tokens(x) for x in inputs]
    else:
        raise ValueError("input: a string, a list of strings, a list of token ids or a list of such lists")
    return protocol.EmbedRequest(
        request_id=request_id,
        texts=texts,
        token_ids=token_ids,
        pooling=PoolingParams(task, dimensions, normalize),
        truncate_prompt_tokens=truncate_prompt_tokens,
        add_special_tokens=add_special_tokens,
    )


def _socket(ctx: zmq.Context, address: str, curve: tuple[str, str] | None) -> zmq.Socket:
    socket = ctx.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        connect_curve(socket, *curve)
    elif address.startswith("tcp://"):
        raise ValueError("a tcp:// frontend needs CURVE keys: curve=(server_public_file, client_secret_file)")
    socket.connect(address)
    return socket


def _close_socket_and_context(socket: zmq.Socket, ctx: zmq.Context) -> None:
    socket.close(linger=0)
    ctx.term()


class AsyncEngineClient:
    """One DEALER socket shared by any number of concurrent requests of this event loop."""

    def __init__(self, address: str, curve: tuple[str, str] | None = None):
        self.ctx = zmq.asyncio.Context()
        self.socket = _socket(self.ctx, address, curve)
        # A client dropped without close(): socket first, then context. Left to the garbage collector,
        # the context may be finalized while its socket is still open, and its term() then waits forever.
        self._finalizer = weakref.finalize(self, _close_socket_and_context, self.socket, self.ctx)
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._prefix = f"{os.getpid()}-{uuid.uuid4().hex[:8]}-"
        self._ids = itertools.count()

    def new_request_id(self) -> str:
        return self._prefix + str(next(self._ids))

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def _send(self, message) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        await self.socket.send(protocol.encoder.encode(message), copy=False)

    async def _read(self) -> None:
        while True:
            # (Handed on at once: a local here would hold the last message, e.g. a 100 MB EmbedResult,
            # until the next one arrives.)
            self._dispatch(await self.socket.recv(copy=False))

    def _dispatch(self, frame: zmq.Frame) -> None:
        message = protocol.frontend_response_decoder.decode(frame.buffer)
        if isinstance(message, protocol.GenerateOutputs):
            for delta in message.deltas:
                queue = self._queues.get(delta.request_id)
                if queue is not None:
                    queue.put_nowait(delta)
        else:
            queue = self._queues.get(message.request_id)
            if queue is not None:
                queue.put_nowait(message)

    async def _call(self, message, timeout: float | None):
        """Send a one-answer request and wait for its answer. A caller that stops waiting (timeout,
        cancellation: its HTTP client went away) has the request dropped from the server's work too
        (a long /tokenize prompt is then not tokenized for nobody)."""
        queue = self._queues[message.request_id] = asyncio.Queue()
        answered = False

        async def exchange():
            # The send is inside the timeout too: a DEALER with no connection (the server refused this
            # client's CURVE key, or is gone) holds a send until one appears, which may be never.
            await self._send(message)
            return await queue.get()

        try:
            answer = await asyncio.wait_for(exchange(), timeout)
            answered = True
        finally:
            self._queues.pop(message.request_id, None)
            if not answered:
                self.post(protocol.AbortRequest([message.request_id]))
        if isinstance(answer, protocol.RequestError):
            raise EngineError(answer)
        return answer

    async def generate(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        messages: list[dict] | None = None,
        prompt_token_ids: list[int] | None = None,
        stop: str | list[str] | None = None,
        request_id: str | None = None,
        **options,
    ) -> AsyncGenerator[protocol.GenerateDelta, None]:
        """Deltas of every sample until all `params.n` have finished. Leaving the loop early (break,
        cancellation, a client disconnect upstream) aborts the request in the engine."""
        request_id = request_id or self.new_request_id()
        request = build_request(request_id, prompt, messages, prompt_token_ids, params, stop, **options)
        queue = self._queues[request_id] = asyncio.Queue()
        remaining = request.params.n
        try:
            await self._send(request)
            while remaining:
                item = await queue.get()
                if isinstance(item, protocol.RequestError):
                    remaining = 0  # the server has dropped the request already
                    raise EngineError(item)
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            self._queues.pop(request_id, None)
            if remaining:
                await self.socket.send(protocol.encoder.encode(protocol.AbortRequest([request_id])))

    async def embed(
        self,
        inputs: EmbedInput,
        *,
        dimensions: int | None = None,
        task: str = "embed",
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        add_special_tokens: bool = True,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> protocol.EmbedResult:
        """Pool each input (an embedding model only): `.embeddings()` of the result is a float32 array
        [inputs, dim] (task="token_embed": `.arrays()`, one [tokens, dim] array per input). `dimensions`: a
        Matryoshka model's shorter embeddings; `truncate_prompt_tokens`: keep at most that many tokens of
        each input (-1: the model's maximum) instead of refusing a longer one. EngineError for what the
        server refuses (status 400, `param` naming the field); a wait cut short (timeout, cancellation)
        aborts the request."""
        request = build_embed_request(
            request_id or self.new_request_id(),
            inputs,
            dimensions,
            task,
            normalize,
            truncate_prompt_tokens,
            add_special_tokens,
        )
        return await self._call(request, timeout)

    def fail_all(self, message: str, status: int = 503) -> None:
        """End every waiting request with an error (the server is going away)."""
        for request_id, queue in self._queues.items():
            queue.put_nowait(
                protocol.RequestError(
                    request_id=request_id,
                    status=status,
                    message=message,
                    error_type="server_error",
                    code="server_shutdown",
                )
            )

    async def reset_prefix_cache(self, timeout: float = 30.0) -> int:
        """Forget every cached prefix; returns the number of cached blocks dropped."""
        result = await self._call(protocol.ResetPrefixCacheRequest(self.new_request_id()), timeout)
        return result.num_blocks

    async def health(self, timeout: float = 5.0) -> protocol.HealthReport:
        return await self._call(protocol.HealthQuery(self.new_request_id()), timeout)

    async def metrics(self, timeout: float = 5.0) -> bytes:
        """Every process's metrics in Prometheus' text format (what GET /metrics serves)."""
        return (await self._call(protocol.MetricsQuery(self.new_request_id()), timeout)).text

    async def dashboard(self, timeout: float = 5.0) -> bytes:
        """The web dashboard's data as JSON (what GET /dashboard.json serves; detok_proc/dashboard.py)."""
        return (await self._call(protocol.DashboardQuery(self.new_request_id()), timeout)).json

    def post(self, message) -> None:
        """Send a message that has no answer (ApiWorkerStats) without waiting; call in the event loop."""
        self.socket.send(protocol.encoder.encode(message))  # pyzmq queues it if it cannot go at once

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        add_special_tokens: bool = True,
        chat: protocol.ChatOptions | None = None,
        return_token_strs: bool = False,
        timeout: float = 30.0,
    ) -> protocol.TokenizeResult:
        return await self._call(
            protocol.TokenizeRequest(
                request_id=self.new_request_id(),
                prompt=prompt,
                messages=messages,
                chat=chat,
                add_special_tokens=add_special_tokens,
                return_token_strs=return_token_strs,
            ),
            timeout,
        )

    async def detokenize(self, token_ids: list[int], timeout: float = 30.0) -> str:
        result = await self._call(
            protocol.DetokenizeRequest(self.new_request_id(), protocol.pack_tokens(token_ids)), timeout
        )
        return result.text

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._finalizer()  # closes the socket, then terms the context (once)

    async def aclose(self) -> None:
        """`close()`, then wait for the reader task to end (so a loop about to stop leaves none pending)."""
        reader = self._reader
        self.close()
        if reader is not None:
            await asyncio.gather(reader, return_exceptions=True)


class EngineClient:
    """Blocking client for scripts and threads that do not run asyncio (one thread at a time).

    A thin wrapper: an `AsyncEngineClient` runs on a private event loop in a daemon thread, and each
    call waits for its coroutine there, so both clients build and send requests the same way."""

    def __init__(self, address: str, curve: tuple[str, str] | None = None):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-client", daemon=True)
        self._thread.start()
        try:
            self._client = self._run(_connect(address, curve))  # its sockets belong to that loop
        except BaseException:
            self._stop_loop()
            raise

    def new_request_id(self) -> str:
        return self._client.new_request_id()

    def _run(self, coroutine, timeout: float | None = None):
        """Run `coroutine` on the client's loop and wait for its result. An asyncio.TimeoutError (its
        `timeout` ran out) is raised as the builtin TimeoutError, which it is not yet on Python 3.10; an
        interrupted wait (Ctrl-C) cancels the coroutine."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer from the server within {timeout}s") from None
        except BaseException:
            if not future.done():  # interrupted while waiting, not an error of the coroutine's
                future.cancel()
            raise

    def generate(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        messages: list[dict] | None = None,
        prompt_token_ids: list[int] | None = None,
        stop: str | list[str] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        **options,
    ) -> Iterator[protocol.GenerateDelta]:
        """Like `AsyncEngineClient.generate`; `timeout` bounds the wait for each delta (TimeoutError,
        and the request is aborted)."""
        deltas = self._client.generate(
            prompt,
            params,
            messages=messages,
            prompt_token_ids=prompt_token_ids,
            stop=stop,
            request_id=request_id,
            **options,
        )
        waiting = False  # for the next delta; still True after a wait that did not return one
        try:
            while True:
                waiting = True
                delta = self._run(_next_delta(deltas, timeout), timeout)
                waiting = False
                if delta is None:
                    return
                yield delta
        finally:
            # Left between deltas (break, close): closing `deltas` aborts the request if unfinished. A
            # wait that failed has ended `deltas` already, or (interrupted) is cancelling it, which
            # aborts; closing it then would fail, as it is still running.
            if not waiting and not self._loop.is_closed():
                self._run(_close_deltas(deltas))

    def embed(self, inputs: EmbedInput, *, timeout: float | None = None, **options) -> protocol.EmbedResult:
        """Like `AsyncEngineClient.embed` (TimeoutError after `timeout` seconds, and the request is aborted)."""
        return self._run(self._client.embed(inputs, timeout=timeout, **options), timeout)

    def health(self, timeout: float = 5.0) -> protocol.HealthReport:
        return self._run(self._client.health(timeout), timeout)

    def metrics(self, timeout: float = 5.0) -> bytes:
        """Every process's metrics in Prometheus' text format."""
        return self._run(self._client.metrics(timeout), timeout)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._client.aclose())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


async def _connect(address: str, curve: tuple[str, str] | None) -> AsyncEngineClient:
    return AsyncEngineClient(address, curve)


async def _next_delta(
    deltas: AsyncGenerator[protocol.GenerateDelta, None], timeout: float | None
) -> protocol.GenerateDelta | None:
    """The next delta, None at the end, asyncio.TimeoutError after `timeout` seconds without one (the
    wait is cancelled, which ends `deltas` and so aborts the request)."""
    try:
        return await asyncio.wait_for(deltas.__anext__(), timeout)
    except StopAsyncIteration:
        return None


async def _close_deltas(deltas: AsyncGenerator[protocol.GenerateDelta, None]) -> None:
    await deltas.aclose()
