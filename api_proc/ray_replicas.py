"""The Ray backend (`--distributed-executor-backend ray`): engine replicas placed on a Ray cluster.

ZeroMQ + msgspec stay the data path; Ray does placement, liveness and clean-up. Each replica is one
local process of `pagoda serve` (started and restarted by the launcher like an engine process, and
named like one) that is a Ray driver for its replica:
- it creates the replica's placement group, a bundle per tensor/pipeline-parallel rank
  (`--ray-cpus-per-rank` CPUs, or one GPU on CUDA), STRICT_PACK on one node (PACK under pipeline
  parallel, whose stages may go to other nodes), and fails start-up after `--ray-placement-timeout`
  with the resources asked for and those the cluster has;
- it starts the engine core in bundle 0 as an actor (engine_core/ray_engine.py), which connects back to
  the tokenizer process over tcp with per-launch CURVE keys, and starts the other ranks as actors in
  the other bundles (engine_core/parallel/ray_ranks.py: shared memory with the ranks on its node, tcp
  with CURVE to the others);
- it reports "ready" when the actor has loaded, then holds the actor's run reference and checks it
  every 0.25 s: an actor that dies (`ray.kill`, a killed process, a lost node) ends this process with
  exit 1 within a second, and the launcher fails the replica's requests and restarts it, in a fresh
  placement group;
- on "stop", or when `pagoda serve` is gone (its pipe closes, even after kill -9), it stops or kills
  the actor and removes the placement group. Actors and groups are owned by this driver, so Ray also
  removes them if this process is killed outright.

Without `--ray-address` the launcher starts a local cluster (`LocalRayCluster`), held by a child process
that takes it down with the server. Ray is imported only here, and only for this backend.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.environment import pagoda_environment
from pagoda.engine_core.lifecycle import ChildLink, Command, ParentLink, Report, Role, init_child_process
from pagoda.engine_core.zmq_security import EngineLinkKeys

logger = logging.getLogger("pagoda.ray")
_WATCH_S = 0.25  # how often the driver checks its actor
_STOP_GRACE_S = 5.0
_ORPHAN_GRACE_S = 2.0  # for an actor to close its engine when `pagoda serve` is gone


@dataclass(frozen=True)
class RaySettings:
    address: str  # the cluster's GCS address
    cpus_per_rank: int
    placement_timeout: float
    namespace: str  # this launch's: its actors and placement groups are named in it
    auth_env: dict[str, str]  # RAY_AUTH_* of a local cluster (one given by address: this environment's)


class PlacementFailed(RuntimeError):
    """A replica's placement group could not be placed in time."""


def engine_link_addrs(num_replicas: int, host: str) -> list[tuple[str, str]]:
    """tcp addresses the tokenizer process binds for each replica (input, output): free ports of
    `host`, which the engines connect to."""
    addrs = []
    for _ in range(num_replicas):
        ports = []
        for _ in range(2):
            with socket.socket() as probe:
                probe.bind((host, 0))
                ports.append(probe.getsockname()[1])
        addrs.append((f"tcp://{host}:{ports[0]}", f"tcp://{host}:{ports[1]}"))
    return addrs


def replica_bundles(config: EngineConfig, cpus_per_rank: int) -> list[dict[str, float]]:
    """The bundles of a replica's placement group, one per rank (bundle r: rank r; rank 0 is the engine
    actor): `cpus_per_rank` CPUs each, and a GPU each on CUDA."""
    bundle: dict[str, float] = {"CPU": float(cpus_per_rank)}
    if config.device.startswith("cuda"):
        bundle["GPU"] = 1.0
    return [dict(bundle) for _ in range(config.num_ranks)]


def placement_strategy(config: EngineConfig) -> str:
    """STRICT_PACK (one node) unless pipeline parallel: then PACK, so that stages may go to other nodes
    when one node cannot hold them all (a tensor-parallel group is best kept on one node, where it
    all-reduces through shared memory or NVLink; Ray packs as tightly as the nodes allow)."""
    return "PACK" if config.pipeline_parallel_size > 1 else "STRICT_PACK"


def actor_config(config: EngineConfig, cpus_per_rank: int) -> EngineConfig:
    """The replica's config as its actors run it: each rank's GPU is the one Ray gave it (Ray sets
    CUDA_VISIBLE_DEVICES), and `cpus_per_rank` torch threads per rank instead of core pinning (Ray
    reserves CPUs but does not say which)."""
    import dataclasses

    device = "cuda" if config.device.startswith("cuda") else config.device
    return dataclasses.replace(
        config,
        device=device,
        data_parallel_rank=0,
        cpu_threads_bind="none",
        num_threads=config.num_threads or cpus_per_rank,
    )


class _ReplicaDriver:
    """The placement group and actor of one replica, created and removed by this process."""

    def __init__(self, settings: RaySettings, replica: int | None):
        os.environ.update(settings.auth_env)  # (before Ray is imported: it reads them then)
        import ray

        self.ray = ray
        self.settings = settings
        self.replica = replica
        self.group = None
        self.actor = None
        self.running = None  # the actor's `run` reference, once it runs
        self._lock = threading.Lock()
        ray.init(
            address=settings.address,
            namespace=settings.namespace,
            logging_level=logging.WARNING,
            log_to_driver=True,
            runtime_env={"env_vars": pagoda_environment()},
        )

    def place(self, bundles: list[dict[str, float]], strategy: str) -> None:
        from ray.util.placement_group import placement_group

        self.group = placement_group(bundles, strategy=strategy)
        ready, _ = self.ray.wait([self.group.ready()], timeout=self.settings.placement_timeout)
        if not ready:
            available = {k: v for k, v in self.ray.available_resources().items() if k in ("CPU", "GPU")}
            total = {k: v for k, v in self.ray.cluster_resources().items() if k in ("CPU", "GPU")}
            where = "on one node" if strategy == "STRICT_PACK" else "on the cluster"
            raise PlacementFailed(
                f"engine replica {self.replica or 0}: Ray could not place {_bundles_text(bundles)} {where} "
                f"within {self.settings.placement_timeout:g}s (--ray-placement-timeout); the cluster has "
                f"{total} in all, {available} available"
            )

    def start(self, config: EngineConfig, input_addr: str, output_addr: str, keys: EngineLinkKeys, bundle: dict):
        """The engine actor (rank 0) in bundle 0; it starts the other ranks in the others."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pagoda.engine_core.ray_engine import EngineActor

        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=0)
        actor_class = self.ray.remote(EngineActor).options(
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            max_concurrency=2,  # `stop` while `run` loops
            max_restarts=0,  # the launcher restarts replicas, in a fresh group
            scheduling_strategy=strategy,
        )
        with self._lock:
            self.actor = actor_class.remote(config, input_addr, output_addr, keys.for_engine(), self.replica)
        return self.actor

    def wait(self, ref, stop: threading.Event) -> bool:
        """Wait for `ref` (True) until `stop` is set (False)."""
        while not stop.is_set():
            done, _ = self.ray.wait([ref], timeout=_WATCH_S)
            if done:
                return True
        return False

    def remove(self, grace_s: float = 0.0) -> None:
        """Kill the actor (with its ranks) and remove the placement group; idempotent. With `grace_s`, a
        running actor is first asked to stop, and given that long to close its engine (which removes the
        parallel group's files and stops the ranks) before it is killed."""
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            actor, self.actor = self.actor, None
            group, self.group = self.group, None
        if actor is not None:
            if grace_s and self.running is not None:
                with contextlib.suppress(Exception):
                    actor.stop.remote()
                    self.ray.wait([self.running], timeout=grace_s)
            self.ray.kill(actor)
        if group is not None:
            remove_placement_group(group)


def _bundles_text(bundles: list[dict[str, float]]) -> str:
    return f"{bundles[0]}" if len(bundles) == 1 else f"{len(bundles)} bundles of {bundles[0]}"


class _DriverLink(ParentLink):
    """The control pipe of a replica's driver: when `pagoda serve` is gone, its actor and placement
    group go too (before the exit the base class makes)."""

    def __init__(self, conn: Connection, runtime_dir: str | None, driver_ref: list):
        super().__init__(conn, runtime_dir)
        self.driver_ref = driver_ref

    def release_when_orphaned(self) -> None:
        if self.driver_ref:
            try:
                self.driver_ref[0].remove(grace_s=_ORPHAN_GRACE_S)
            except Exception:
                logger.exception("removing the replica's actor")


def run_ray_replica(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    link_keys: EngineLinkKeys,
    settings: RaySettings,
    parent_conn: Connection | None = None,
    runtime_dir: str | None = None,
    replica: int | None = None,
) -> None:
    """Process entry point (the launcher's engine target under the Ray backend): place, start and watch
    one replica's engine actor. Exits 0 after "stop", 1 when the replica fails or cannot be placed."""
    init_child_process(Role.ENGINE.process_name(replica), Role.ENGINE.process_title(replica))
    driver_ref: list[_ReplicaDriver] = []
    stop = threading.Event()
    link = _DriverLink(parent_conn, runtime_dir, driver_ref) if parent_conn is not None else None
    if link is not None:
        link.watch(lambda command, info: stop.set())
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the parent decides (as for an engine process)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    status = 0
    try:
        driver = _ReplicaDriver(settings, replica)
        driver_ref.append(driver)
        bundles = replica_bundles(config, settings.cpus_per_rank)
        driver.place(bundles, placement_strategy(config))
        actor = driver.start(
            actor_config(config, settings.cpus_per_rank), input_addr, output_addr, link_keys, bundles[0]
        )
        loaded = actor.load.remote()
        if not driver.wait(loaded, stop):
            return
        info = driver.ray.get(loaded)
        if link is not None:
            link.send(Report.READY, **info)
        running = driver.running = actor.run.remote()
        if driver.wait(running, stop):
            driver.ray.get(running)  # (raises what ended the actor)
            return
        actor.stop.remote()
        driver.ray.wait([running], timeout=_STOP_GRACE_S)
    except Exception as exc:  # noqa: BLE001 - any failure ends the replica; the launcher decides what next
        logger.error("engine replica %s failed: %s", replica or 0, exc)
        status = 1
    finally:
        for driver in driver_ref:
            driver.remove()
            driver.ray.shutdown()
    if status:
        raise SystemExit(status)


class LocalRayCluster:
    """A Ray cluster on this machine for one `pagoda serve` (no --ray-address), held by a child process
    of the launcher (`pagoda-ray`, see `run_ray_head`): stopped with the server, and killed with every
    process of it when the launcher dies, even by kill -9."""

    def __init__(self, timeout_s: float = 120.0):
        import multiprocessing

        mp = multiprocessing.get_context("spawn")
        parent_end, child_end = mp.Pipe()
        self.process = mp.Process(target=run_ray_head, args=(child_end,), name="ray_head", daemon=False)
        self.process.start()
        child_end.close()
        self.link = ChildLink("ray_head", parent_end)
        try:
            if not parent_end.poll(timeout_s):
                raise RuntimeError(f"the local Ray cluster did not start within {timeout_s:g}s")
            _, info = self.link.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise RuntimeError(f"the local Ray cluster failed to start (exit code {self.process.exitcode})") from None
        except BaseException:
            self.close()
            raise
        self.address: str = info["address"]
        self.auth_env: dict[str, str] = info["auth"]
        logger.info("started a local Ray cluster at %s", self.address)

    def close(self) -> None:
        self.link.send(Command.STOP)
        self.process.join(_STOP_GRACE_S * 3)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(_STOP_GRACE_S)


def run_ray_head(parent_conn: Connection) -> None:
    """Process entry point of `pagoda-ray`: start a local Ray cluster (its processes are this one's
    children), report its address, and hold it until "stop" or until the launcher is gone; then shut it
    down and kill whatever of it is left (Ray's per-node agents outlive a killed raylet by a minute)."""
    init_child_process("pagoda-ray", "pagoda: ray")
    # A session directory of its own (short: Ray puts unix sockets there), not /tmp/ray's shared
    # "session_latest", which another cluster on this machine may be using.
    temp_dir = tempfile.mkdtemp(prefix="pagoda-ray-", dir="/tmp")
    # The cluster's processes (the engine actors) make their temporary files, such as a parallel
    # group's directory, inside the cluster's directory: removed with it even after a kill -9 that
    # leaves none of them to clean up.
    os.environ["TMPDIR"] = os.path.join(temp_dir, "tmp")
    os.mkdir(os.environ["TMPDIR"])
    link = _HeadLink(parent_conn, temp_dir)
    stop = threading.Event()
    link.watch(lambda command, info: stop.set())
    import ray

    context = ray.init(
        include_dashboard=False, logging_level=logging.WARNING, configure_logging=False, _temp_dir=temp_dir
    )
    # After ray.init, which installs its own: the launcher decides when this stops (its death is the
    # parent-death SIGTERM, handled like the pipe's end).
    signal.signal(signal.SIGTERM, lambda signum, frame: link.orphaned())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Ray's token authentication, as ray.init set it up for this process and its children: what the
    # replicas' drivers (the launcher's children, not this one's) need to join.
    auth = {name: value for name, value in os.environ.items() if name.startswith("RAY_AUTH_")}
    link.send(Report.READY, address=context.address_info["gcs_address"], auth=auth)
    stop.wait()
    ray.shutdown()
    kill_descendants()
    shutil.rmtree(temp_dir, ignore_errors=True)


class _HeadLink(ParentLink):
    def release_when_orphaned(self) -> None:
        kill_descendants()


def kill_descendants() -> None:
    """SIGKILL every process below this one (children first listed, then theirs: all collected first)
    but Python's resource trackers: once the processes they serve are gone they unlink the shared memory
    those registered (an engine's step ring), then exit by themselves."""
    found: list[int] = []
    pending = [os.getpid()]
    while pending:
        pid = pending.pop()
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                children = [int(c) for c in (task / "children").read_text().split()]
                found += children
                pending += children
    for pid in found:
        if _is_resource_tracker(pid):
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _is_resource_tracker(pid: int) -> bool:
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def node_ip() -> str:
    """This machine's address as Ray sees it (what engines on other nodes connect back to)."""
    import ray

    return ray.util.get_node_ip_address()


def launch_namespace() -> str:
    return f"pagoda-{os.getpid()}"
