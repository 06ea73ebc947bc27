"""Ranks 1..N-1 of a replica as Ray actors (the Ray backend), in the replica's placement group.

The engine actor (engine_core/ray_engine.py) is rank 0 in bundle 0 of its replica's placement group;
it starts rank r as a `RankActor` in bundle r. The rank actors are owned by the engine actor, so Ray
kills them when it dies (and it dies with the replica's driver, api_proc/ray_replicas.py). Ranks Ray
placed on the engine actor's node get the steps through shared memory; ranks on other nodes (a
pipeline stage that did not fit on the first node) get them over tcp with CURVE, and every rank then
meets at rank 0's TCPStore (engine_core/parallel/executor.py).

Ray is imported only here, only under this backend.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pagoda.engine_core import cpu_binding
from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.environment import log_settings
from pagoda.engine_core.lifecycle import configure_logging, name_process
from pagoda.engine_core.parallel.ranks import START_TIMEOUT_S, WorkerDied, rank_name
from pagoda.engine_core.parallel.worker import WorkerSpec, serve

logger = logging.getLogger(__name__)
_CHECK_EVERY_S = 0.25  # how often `first_dead` asks Ray (a step costs less than a Ray call)


class RankActor:
    """One rank: follows rank 0's steps in `run` until told to stop."""

    def __init__(self, rank: int):
        name_process(f"pagoda-tp{rank}", f"pagoda: tp worker {rank}")
        configure_logging(log_settings()[0])

    def where(self) -> str:
        """The node this rank runs on (the engine waits for this answer: the actor has started)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def run(self, spec: WorkerSpec) -> None:
        cpu_binding.apply(None, spec.config.num_threads)  # (Ray reserves CPUs but does not say which)
        try:
            serve(spec, on_joining=lambda: None)
        except Exception:
            logger.exception("parallel rank %d failed", spec.rank)
            raise


class RayRanks:
    """The rank actors of the placement group the calling actor (rank 0) runs in."""

    pins_cores = False

    def __init__(self) -> None:
        import ray
        from ray.util import get_current_placement_group

        self.ray = ray
        group = get_current_placement_group()
        if group is None:
            raise RuntimeError("the Ray backend's engine runs outside a placement group")
        self.group = group
        table = ray.util.placement_group_table(self.group)
        self._bundles: dict[int, dict[str, float]] = {int(i): b for i, b in table["bundles"].items()}
        self._nodes: dict[int, str] = {int(i): node for i, node in table["bundles_to_node_id"].items()}
        self._addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
        self._names: dict[int, str] = {}
        self.actors: dict[int, Any] = {}  # rank -> its actor handle
        self.runs: dict[int, object] = {}  # rank -> the reference of its `run`, done when it ends
        self._checked_at = 0.0
        self._dead: str | None = None

    def nodes(self, world_size: int) -> list[str]:
        if len(self._nodes) < world_size:
            raise RuntimeError(f"the placement group has {len(self._nodes)} bundles for {world_size} ranks")
        return [self._nodes[rank] for rank in range(world_size)]

    def address(self, rank: int) -> str:
        return self._addresses[self._nodes[rank]]

    def rank_config(self, config: EngineConfig, rank: int) -> EngineConfig:
        return config  # (on CUDA each actor sees only the GPU of its bundle, as cuda:0)

    def start(self, specs: list[WorkerSpec]) -> None:
        from ray.exceptions import RayError
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        for spec in specs:
            bundle = self._bundles[spec.rank]
            self._names[spec.rank] = (
                f"{rank_name(spec.rank, spec.tensor_parallel_size, spec.pipeline_parallel_size)} "
                f"(Ray actor on node {self._nodes[spec.rank][:12]})"
            )
            self.actors[spec.rank] = (
                self.ray.remote(RankActor)
                .options(
                    num_cpus=bundle.get("CPU", 0),
                    num_gpus=bundle.get("GPU", 0),
                    max_restarts=0,  # a replica whose rank died is restarted whole, by the launcher
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, spec.rank),
                )
                .remote(spec.rank)
            )
        started = {rank: actor.where.remote() for rank, actor in self.actors.items()}
        ready, _ = self.ray.wait(list(started.values()), num_returns=len(started), timeout=START_TIMEOUT_S)
        for rank, ref in started.items():
            if ref not in ready:
                raise WorkerDied(f"{self._names[rank]} did not start within {START_TIMEOUT_S:g}s")
            try:
                self.ray.get(ref)
            except RayError as exc:
                raise WorkerDied(f"{self._names[rank]} failed to start: {_first_line(exc)}") from None
        for spec in specs:
            self.runs[spec.rank] = self.actors[spec.rank].run.remote(spec)

    def first_dead(self) -> str | None:
        now = time.monotonic()
        if self._dead is not None or not self.runs or now - self._checked_at < _CHECK_EVERY_S:
            return self._dead
        self._checked_at = now
        done, _ = self.ray.wait(list(self.runs.values()), num_returns=1, timeout=0)
        if done:
            rank = next(r for r, ref in self.runs.items() if ref == done[0])
            try:
                self.ray.get(done[0])
                how = "stopped"
            except Exception as exc:  # noqa: BLE001 - whatever ended it is what we report
                how = f"died ({_first_line(exc)})"
            self._dead = f"{self._names[rank]} {how}"
        return self._dead

    def stop(self, grace_s: float) -> None:
        if self.runs:
            self.ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=grace_s)
        for actor in self.actors.values():
            self.ray.kill(actor)
        self.actors = {}
        self.runs = {}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
