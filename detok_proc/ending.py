"""Ending client requests before their end: a client's abort (or its vanishing), this process failing on a
request (a 500 naming no internal detail), the engine refusing or failing one, and a replica going down
with the requests it was running. Whatever the request is (generating, embedding, or still being
tokenized), its engine work stops and its client is answered at most once.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable

from pagoda.detok_proc.generation import GenerationFrontend
from pagoda.detok_proc.pooling import PoolingFrontend
from pagoda.detok_proc.replicas import EngineReplica
from pagoda.detok_proc.requests import RequestInvalid
from pagoda.detok_proc.tokenizing import PromptTokenizer
from pagoda.engine_core import protocol

logger = logging.getLogger(__name__)


class RequestEnding:
    def __init__(
        self,
        prompts: PromptTokenizer,
        replicas: list[EngineReplica],
        generations: GenerationFrontend,
        pooling: PoolingFrontend,
        reply: Callable[[bytes, object], None],
    ):
        self.prompts = prompts
        self.replicas = replicas
        self.generations = generations
        self.pooling = pooling
        self.reply = reply

    def abort(self, identity: bytes, request_ids: list[str], by_client: bool = False) -> None:
        """Stop the engine work of these requests; `by_client`: the client asked (or vanished), so
        they count as finished by ABORT in the metrics; errors end requests uncounted."""
        by_replica: dict[int, list[str]] = defaultdict(list)
        for request_id in request_ids:
            self.prompts.cancel((identity, request_id))
            pooled = self.pooling.abort((identity, request_id))
            if pooled is not None:
                by_replica[pooled[0]].extend(pooled[1])
            for index, engine_id in self.generations.abort((identity, request_id), by_client):
                by_replica[index].append(engine_id)
        for index, engine_ids in by_replica.items():
            if self.replicas[index].serving:  # (a replica that is down has forgotten them already)
                self.replicas[index].send(protocol.AbortRequests(engine_ids))

    def abort_client(self, identity: bytes) -> None:
        self.abort(
            identity,
            [
                rid
                for ident, rid in [*self.generations.by_client, *self.pooling.by_client, *self.prompts.pending_keys()]
                if ident == identity
            ],
            by_client=True,
        )

    def failed(self, client: bytes, request_id: str, exc: Exception) -> None:
        """Answer a request this process failed on with a 500 that names no internal detail (logged)."""
        logger.error("request %r from a client failed", request_id, exc_info=exc)
        self.end_with_server_error(
            client, request_id, "the request failed on an internal error (the server log has the details)"
        )

    def end_with_server_error(self, client: bytes, request_id: str, message: str, code: str | None = None) -> None:
        """End a client's request (every sample of it) with a 500 carrying `message`, written for the client."""
        self.abort(client, [request_id])
        self.reply(
            client,
            protocol.RequestError(
                request_id=request_id, status=500, error_type="server_error", message=message, code=code
            ),
        )

    def rejected(self, message: protocol.RequestRejected) -> None:
        """The engine refused a request (a generation's sample or an embedding's input): a 400 for its client."""
        key = self.generations.owner(message.request_id) or self.pooling.owner(message.request_id)
        if key is None:
            return
        self.abort(key[0], [key[1]])
        self.reply(key[0], RequestInvalid(message.message, message.param).to_message(key[1]))

    def engine_failed(self, message: protocol.RequestFailed) -> None:
        """A request the engine ended mid-way because of its own data: it (with its `n` siblings) fails
        with a 500; the engine serves on."""
        key = self.generations.owner(message.request_id)
        if key is None:  # (its client is gone, or a sibling's failure already ended it)
            return
        self.end_with_server_error(key[0], key[1], message.message, "request_failed")

    def replica_down(self, index: int, message: str) -> None:
        """Every request replica `index` was running fails with a 500 carrying `message` (the others' go on)."""
        failed = self.generations.on_replica(index)
        failed.update(self.pooling.on_replica(index))
        for identity, request_id in failed:
            self.generations.abort((identity, request_id), by_client=False)
            self.reply(
                identity,
                protocol.RequestError(
                    request_id=request_id, status=500, message=message, error_type="server_error", code="engine_dead"
                ),
            )
