"""/reset_prefix_cache across engine replicas: the reset goes to every serving replica, and the client is
answered once each has answered or gone down (the blocks dropped in all, or 503 when none answered)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagoda.detok_proc.replicas import EngineReplica
from pagoda.engine_core import protocol


@dataclass
class PendingReset:
    """A /reset_prefix_cache sent to every serving replica, answered once each has answered."""

    client: bytes
    request_id: str
    waiting: set[int]  # replicas yet to answer
    answered: int = 0
    num_blocks: int = 0
    failures: list[str] = field(default_factory=list)


class PrefixCacheResets:
    def __init__(self, reply: Callable[[bytes, object], None], new_engine_id: Callable[[], str]):
        self.reply = reply
        self.new_engine_id = new_engine_id
        self._pending_resets: dict[str, PendingReset] = {}  # engine request id -> the client's reset

    def start(self, identity: bytes, request_id: str, replicas: list[EngineReplica]) -> None:
        engine_id = f"reset-{self.new_engine_id()}"
        serving = [r for r in replicas if r.serving]
        self._pending_resets[engine_id] = PendingReset(identity, request_id, {r.index for r in serving})
        for replica in serving:
            replica.send(protocol.ResetPrefixCache(engine_id))

    def answered(self, replica: EngineReplica, message: protocol.PrefixCacheReset) -> None:
        reset = self._pending_resets.get(message.request_id)
        if reset is not None and replica.index in reset.waiting:
            reset.waiting.discard(replica.index)
            reset.answered += 1
            reset.num_blocks += message.num_blocks
            self._reset_answered(message.request_id, reset)

    def replica_down(self, index: int, message: str) -> None:
        """Replica `index` will not answer: the resets waiting for it count `message` as its failure."""
        for engine_id, reset in list(self._pending_resets.items()):
            if index in reset.waiting:
                reset.waiting.discard(index)
                reset.failures.append(message)
                self._reset_answered(engine_id, reset)

    def _reset_answered(self, engine_id: str, reset: PendingReset) -> None:
        """Answer a reset once no replica is left to answer: the blocks every replica that answered
        dropped (a replica that went down meanwhile has no cache left), or 503 if none answered."""
        if reset.waiting:
            return
        del self._pending_resets[engine_id]
        if reset.answered:
            self.reply(reset.client, protocol.PrefixCacheResetResult(reset.request_id, reset.num_blocks))
        else:
            self.reply(
                reset.client,
                protocol.RequestError(
                    request_id=reset.request_id,
                    status=503,
                    message=reset.failures[0] if reset.failures else "no engine replica is serving",
                    error_type="server_error",
                    code="engine_dead",
                ),
            )
