"""An engine core as a Ray actor: what the Ray backend places on a cluster (api_proc/ray_replicas.py
creates, watches and removes it).

The actor holds an `EngineCoreProc` that connects back to the tokenizer process over tcp with CURVE
(`EngineLinkKeys`, handed over in the constructor), then works exactly as the engine process does:
`load` builds and warms up the engine (it is rank 0 of a tensor/pipeline-parallel replica, in bundle 0
of the replica's placement group; the other ranks start as Ray actors in the other bundles:
engine_core/parallel/ray_ranks.py), `run` is the busy loop until `stop` (a second call, hence a threaded
actor) or a Shutdown. Ray is not imported here: the backend wraps this class with `ray.remote`.
"""

from __future__ import annotations

import logging
import socket
import time

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core_proc import EngineCoreProc, dead_message
from pagoda.engine_core.environment import log_settings
from pagoda.engine_core.lifecycle import Role, configure_logging, name_process
from pagoda.engine_core.zmq_security import EngineLinkKeys

logger = logging.getLogger(__name__)


class EngineActor:
    def __init__(
        self, config: EngineConfig, input_addr: str, output_addr: str, link_keys: EngineLinkKeys, replica: int | None
    ):
        name_process(Role.ENGINE.process_name(replica))
        configure_logging(log_settings()[0])  # (the launcher's, passed in the actor's environment)
        self.config = config
        self.proc = EngineCoreProc(input_addr, output_addr, link_keys)

    def load(self) -> dict:
        """Build and warm up the engine; what the launcher logs as "ready"."""
        started = time.monotonic()
        try:
            ranks = None
            if self.config.num_ranks > 1:
                from pagoda.engine_core.parallel.ray_ranks import RayRanks

                ranks = RayRanks()
            self.proc.load(self.config, ranks)
        except Exception as exc:
            self._fail(exc)
            raise
        return {
            "host": socket.gethostname(),
            "seconds": round(time.monotonic() - started, 2),
            "num_blocks": self.proc.engine.runner.num_blocks,
            "max_model_len": self.proc.engine.max_model_len,
        }

    def run(self) -> None:
        """The engine loop, until `stop` or a Shutdown; a failure is reported to the clients (EngineDead)
        and raised."""
        try:
            self.proc.run()
        except Exception as exc:
            self._fail(exc)
            raise
        self.proc.close()

    def stop(self) -> None:
        self.proc.stop_requested = True

    def _fail(self, exc: Exception) -> None:
        logger.exception("engine core failed")
        self.proc._send(dead_message(exc))
        self.proc.close()
