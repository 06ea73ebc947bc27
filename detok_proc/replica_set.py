"""The engine replicas as one: what they serve together, which replica a request goes to (routing.py),
whether the server can take requests now (else 503), and the /health report over all of them."""

from __future__ import annotations

import time

from pagoda.detok_proc.replicas import EngineReplica
from pagoda.detok_proc.requests import RequestInvalid
from pagoda.detok_proc.routing import Router
from pagoda.engine_core import protocol
from pagoda.engine_core.block_hash import extend_block_hashes
from pagoda.engine_core.gguf_model import model_source


class ReplicaSet:
    def __init__(self, replicas: list[EngineReplica], router: Router, stall_timeout: float, model_dir: str):
        self.replicas = replicas
        self.router = router
        self.stall_timeout = stall_timeout
        self.model_dir = model_dir
        # What every replica serves (vocabulary, context length: the smallest any replica reported).
        self.engine: protocol.EngineReady | None = None

    def replica_ready(self, message: protocol.EngineReady) -> None:
        if self.engine is None or message.max_model_len < self.engine.max_model_len:
            self.engine = message

    def require_engine(self) -> protocol.EngineReady:
        """What the engines serve, while at least one replica serves; else 503."""
        if self.engine is not None and any(r.serving for r in self.replicas):
            return self.engine
        failed = [r for r in self.replicas if r.failure is not None]
        if not failed:
            raise RequestInvalid("the server is starting; try again shortly", status=503, code="not_ready")
        if len(self.replicas) == 1:
            message = f"the engine has failed: {failed[0].failure}"
        else:
            message = "no engine replica is serving: " + "; ".join(
                f"engine {r.index}: {r.status(self.stall_timeout)[1]}" for r in self.replicas
            )
        raise RequestInvalid(message, status=503, code="engine_dead")

    def route(self, ids: list[int], cache_salt: str | None, block_size: int) -> EngineReplica:
        """The replica for a request (routing.py); with one engine, that engine."""
        if len(self.replicas) == 1:
            return self.replicas[0]
        prefix: list[bytes] = []  # its first full block's hash, as the engine's prefix cache keys it
        extend_block_hashes(prefix, ids[:block_size], block_size, cache_salt)
        index = self.router.route([r.load() for r in self.replicas], prefix[0] if prefix else None)
        return self.replicas[index]

    def health(self, request_id: str) -> protocol.HealthReport:
        """One engine: its state. Several: healthy while any replica serves, degraded while another
        does not (down, restarting, stalled or still starting)."""
        now = time.monotonic()
        engines = [r.health(self.stall_timeout) for r in self.replicas]
        ok = [e for e in engines if e.state == "ok"]
        if len(engines) == 1:
            healthy, degraded, message = bool(ok), False, engines[0].message
        elif not ok:
            healthy, degraded = False, False
            message = "no engine replica is serving: " + "; ".join(f"engine {e.index}: {e.message}" for e in engines)
        elif len(ok) < len(engines):
            healthy, degraded = True, True
            message = f"degraded: {len(ok)} of {len(engines)} engine replicas serving; " + "; ".join(
                f"engine {e.index}: {e.message}" for e in engines if e.state != "ok"
            )
        else:
            healthy, degraded, message = True, False, "ok"
        # The watchdog's measure (api_proc/sd_notify.py): the longest silence of a serving replica.
        serving = [r for r in self.replicas if r.serving] or self.replicas
        silence = max(now - r.last_message for r in serving)
        ready = self.engine is not None
        usages = [e.kv_cache_usage for e, r in zip(engines, self.replicas, strict=True) if r.serving]
        return protocol.HealthReport(
            request_id=request_id,
            ready=ready,
            healthy=healthy,
            message=message,
            model=model_source(self.model_dir),  # a GGUF's file, not the directory made from it
            max_model_len=self.engine.max_model_len if self.engine is not None else 0,
            seconds_since_engine_progress=silence,
            num_running=sum(e.num_running for e in engines),
            num_waiting=sum(e.num_waiting for e in engines),
            kv_cache_usage=sum(usages) / len(usages) if usages else 0.0,
            quantization=self.engine.quantization if self.engine is not None else None,
            weight_bytes=self.engine.weight_bytes if self.engine is not None else 0,
            degraded=degraded,
            engines=engines,
        )
