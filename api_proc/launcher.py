"""`pagoda serve`: the parent process that starts, watches and stops the server's processes.

    parent ── engine_core × D (model, KV cache, busy loop; D = --data-parallel-size replicas)
           ── detok_proc  (tokenizer, frontend socket, routing over the replicas)
           ── api_proc × N (aiohttp, sharing the port with SO_REUSEPORT)

Start-up waits for each child's "ready" and logs each phase. Afterwards the parent only watches: a
child that exits on its own makes the server fail fast (in-flight requests get an error, exit 1, so a
supervisor restarts it) — except an engine replica when there are several: the tokenizer process
fails that replica's requests, the others serve on, and the replica is restarted with a backoff
(api_proc/replica_restarts.py). SIGTERM/SIGINT drain (HTTP stops accepting, in-flight requests finish up to
--shutdown-timeout), then stop the rest and exit 0. The runtime directory holding the ipc sockets is
removed on every path, by the parent or, if the parent is SIGKILLed, by the orphaned children.
Under systemd (Type=notify) the parent also reports READY=1, STOPPING=1 and engine-loop watchdog pings
(api_proc/sd_notify.py).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path

from pagoda.engine_core.identity import DEFAULT_SERVED_MODEL_NAME
from pagoda.engine_core.lifecycle import ChildLink, Command, Report, Role

logger = logging.getLogger("pagoda.serve")
_START_TIMEOUT_S = 600.0
_STOP_GRACE_S = 5.0


@dataclass
class Child:
    role: Role
    name: str  # the role, and the worker's index for API workers ("api_0")
    process: multiprocessing.Process
    link: ChildLink
    index: int | None = None  # API workers' and engine replicas' index
    ready: bool = False
    link_open: bool = True  # False once its control pipe reached EOF (the process is exiting)


class Supervisor:
    def __init__(self, runtime_dir: str):
        self.runtime_dir = runtime_dir
        self.mp = multiprocessing.get_context("spawn")
        self.children: list[Child] = []
        self.stop_signal: int | None = None
        self.on_report = lambda child, kind, info: None  # reports after start-up other than READY

    def start(self, role: Role, target, *args, index: int | None = None, **kwargs) -> Child:
        name = role.value if index is None else f"{role.value}_{index}"
        parent_end, child_end = self.mp.Pipe()
        process = self.mp.Process(
            target=target,
            args=args,
            name=name,
            daemon=False,
            kwargs={**kwargs, "parent_conn": child_end, "runtime_dir": self.runtime_dir},
        )
        process.start()
        child_end.close()
        child = Child(role, name, process, ChildLink(name, parent_end), index)
        self.children.append(child)
        return child

    def _on_signal(self, signum, frame) -> None:
        self.stop_signal = signum

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def wait_ready(self, started: float) -> Child | None:
        """Wait until every child said "ready"; return a child that died first, or the first child
        still not ready when the start-up timeout ran out (None after a stop signal)."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not all(c.ready for c in self.children):
            if self.stop_signal is not None:
                return None
            if time.monotonic() > deadline:
                late = next(c for c in self.children if not c.ready)
                logger.error("%s not ready after %.0fs", late.name, _START_TIMEOUT_S)
                return late
            pending = {c.link.conn: c for c in self.children if not c.ready}
            sentinels = {c.process.sentinel: c for c in self.children}
            for obj in wait(list(pending) + list(sentinels), timeout=0.2):
                if obj in sentinels:
                    return sentinels[obj]
                child = pending[obj]
                try:
                    kind, info = child.link.recv()
                except (EOFError, OSError):
                    return child
                if kind is Report.READY:
                    child.ready = True
                    details = ", ".join(f"{k}={v}" for k, v in info.items())
                    logger.info(
                        "%s ready after %.1fs%s",
                        child.name,
                        time.monotonic() - started,
                        f" ({details})" if details else "",
                    )
        return None

    def wait_serving(self, timeout: float = 10.0) -> bool:
        """After "serve": wait until every API worker confirms that its /health answers 200 now; False
        if one died (`watch` then reports it), a stop signal came or the time ran out."""
        waiting = {c.link.conn: c for c in self.children if c.role is Role.API}
        deadline = time.monotonic() + timeout
        while waiting and self.stop_signal is None and time.monotonic() < deadline:
            for conn in wait(list(waiting), timeout=0.2):
                try:
                    kind, _ = waiting[conn].link.recv()
                except (EOFError, OSError):
                    return False
                if kind is Report.SERVING:
                    del waiting[conn]
        if waiting and self.stop_signal is None and all(c.process.is_alive() for c in waiting.values()):
            logger.warning(
                "%s did not confirm serving within %.0fs", ", ".join(c.name for c in waiting.values()), timeout
            )
        return not waiting

    def watch(self, until: float | None = None) -> Child | None:
        """Block until a stop signal (None), a child exits (that child) or time.monotonic() reaches
        `until` (None). Meanwhile reports arrive: a restarted replica's READY, and the tokenizer
        process's (`on_report`)."""
        while self.stop_signal is None and (until is None or time.monotonic() < until):
            sentinels = {c.process.sentinel: c for c in self.children}
            links = {c.link.conn: c for c in self.children if c.link_open and (c.role is Role.DETOK or not c.ready)}
            timeout = 0.2 if until is None else max(0.0, min(0.2, until - time.monotonic()))
            for obj in wait(list(sentinels) + list(links), timeout=timeout):
                if obj in sentinels:
                    return sentinels[obj]
                self._report(links[obj])
        return None

    def _report(self, child: Child) -> None:
        try:
            kind, info = child.link.recv()
        except (EOFError, OSError):  # it is exiting: its sentinel tells
            child.link_open = False
            return
        if kind is Report.READY and not child.ready:
            child.ready = True
            logger.info("%s ready again (%s)", child.name, ", ".join(f"{k}={v}" for k, v in info.items()))
        else:
            self.on_report(child, kind, info)

    def forget(self, child: Child) -> None:
        """A child that has exited: reaped, its pipe closed, no longer watched."""
        child.process.join(1.0)
        child.link.conn.close()
        self.children.remove(child)

    def find(self, role: Role, index: int | None = None) -> Child | None:
        return next((c for c in self.children if c.role is role and c.index == index), None)

    def tell(self, roles: tuple[Role, ...], command: Command) -> None:
        for child in self.children:
            if child.role in roles:
                child.link.send(command)

    def join(self, roles: tuple[Role, ...], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for child in self.children:
            if child.role in roles:
                child.process.join(max(0.0, deadline - time.monotonic()))

    def kill_remaining(self) -> None:
        for child in self.children:
            if child.process.is_alive():
                logger.warning("%s did not exit in time; killing it", child.name)
                child.process.kill()
        for child in self.children:
            child.process.join(2.0)

    def drain(self, shutdown_timeout: float) -> None:
        logger.info("draining: no new requests; waiting up to %.0fs for in-flight ones", shutdown_timeout)
        self.tell((Role.API,), Command.DRAIN)
        self.join((Role.API,), shutdown_timeout + _STOP_GRACE_S)
        self.tell((Role.DETOK, Role.ENGINE), Command.STOP)
        self.join((Role.DETOK, Role.ENGINE), _STOP_GRACE_S)
        self.kill_remaining()

    def fail(self) -> None:
        self.tell((Role.API,), Command.FAIL)
        self.join((Role.API,), 1.0)
        self.tell((Role.DETOK, Role.ENGINE), Command.STOP)
        self.join((Role.DETOK, Role.ENGINE), 0.5)
        self.kill_remaining()


def port_is_free(host: str, port: int) -> bool:
    """Bind without SO_REUSEPORT first, so two servers never silently share one port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def metrics_model_name(served_model_names: list[str] | None, model: str | None) -> str:
    """The `model_name` label of the public /metrics: the first served name, except that a local model
    directory or .gguf file served under its path (no --served-model-name) is named by its last path
    component, so an unauthenticated scrape learns no file path (/v1/models, behind the key, still
    lists the path, which requests name)."""
    if served_model_names:
        return served_model_names[0]
    if model is None:
        return DEFAULT_SERVED_MODEL_NAME
    path = Path(model).expanduser()
    return path.resolve().name if path.exists() else model  # (else a hub id: owner/name, no path)


def make_runtime_dir() -> str:
    """A private (0700) directory for this instance's ipc sockets."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.access(base, os.W_OK):
        base = None
    return tempfile.mkdtemp(prefix="pagoda-", dir=base)


def serve(args) -> int:
    """Run the server until a signal or a failure; the exit status for the shell or systemd."""
    from pagoda.api_proc.engine_replicas import EngineReplicas
    from pagoda.api_proc.process_settings import api_settings, frontend_limits
    from pagoda.api_proc.sd_notify import SystemdService
    from pagoda.api_proc.worker import run_api_worker
    from pagoda.detok_proc.server import run_detok
    from pagoda.engine_core.config import engine_config_from_args
    from pagoda.engine_core.core_proc import run_engine_core
    from pagoda.engine_core.loader import resolve_model
    from pagoda.engine_core.zmq_security import CurveConfig

    started = time.monotonic()
    systemd = SystemdService()  # no-op unless run by systemd (Type=notify)
    if not port_is_free(args.host, args.port):
        logger.error("cannot listen on %s:%d: the address is in use", args.host, args.port)
        return 2
    curve = None
    if args.frontend and args.frontend.startswith("tcp://"):
        if not args.curve_keys:
            logger.error("--frontend tcp://... needs --curve-keys DIR (create one with `pagoda keys DIR`)")
            return 2
        curve = CurveConfig(
            os.path.join(args.curve_keys, "server.key_secret"), os.path.join(args.curve_keys, "authorized")
        )
    model_dir = str(resolve_model(args.model))
    logger.info("model directory %s (resolved in %.1fs)", model_dir, time.monotonic() - started)
    config = dataclasses.replace(engine_config_from_args(args), model=model_dir)
    runtime_dir = make_runtime_dir()
    frontend = f"ipc://{runtime_dir}/frontend.sock"
    frontends = [frontend] + ([args.frontend] if args.frontend and not args.frontend.startswith("tcp://") else [])
    names = args.served_model_name or [args.model or DEFAULT_SERVED_MODEL_NAME]
    try:
        settings = api_settings(args, frontend, names)
    except ValueError:  # e.g. a key too short: nothing started, so nothing of this instance may stay
        shutil.rmtree(runtime_dir, ignore_errors=True)
        raise

    supervisor = Supervisor(runtime_dir)
    status = 1
    cluster = None
    link_keys = None
    try:
        if args.distributed_executor_backend == "ray":
            cluster, engines, link_keys = _ray_replicas(args, supervisor, config)
        else:
            engines = EngineReplicas(
                supervisor, run_engine_core, config, args.data_parallel_size, args.max_replica_restarts
            )
    except ValueError as exc:  # e.g. a --cpu-threads-bind that does not fit the replicas
        shutil.rmtree(runtime_dir, ignore_errors=True)
        logger.error("%s", exc)
        return 2
    supervisor.on_report = lambda child, kind, info: (
        engines.kill_stalled(info["index"]) if kind is Report.REPLICA_STALLED else None
    )
    supervisor.install_signal_handlers()
    systemd.status(f"starting: loading {model_dir}")
    try:
        engines.start_all()
        supervisor.start(
            Role.DETOK,
            run_detok,
            model_dir,
            frontends,
            engines.addrs,
            args.engine_stall_timeout,
            curve and args.frontend,
            curve,
            limits=frontend_limits(args),
            model_name=metrics_model_name(args.served_model_name, args.model),
            routing=args.dp_routing,
            seed=args.seed,
            link_keys=link_keys,
            otlp_traces_endpoint=args.otlp_traces_endpoint,
            metrics_interval=args.metrics_interval,
        )
        for i in range(args.api_workers):
            supervisor.start(Role.API, run_api_worker, settings, index=i, worker=i)
        dead = supervisor.wait_ready(started)
        if dead is not None or supervisor.stop_signal is not None:
            if dead is not None:
                logger.error("%s failed during start-up (exit code %s)", dead.name, dead.process.exitcode)
            supervisor.fail()
            return 1 if dead is not None or supervisor.stop_signal is None else 0
        supervisor.tell((Role.API,), Command.SERVE)
        supervisor.wait_serving()  # a worker that died instead is caught by watch() right below
        if supervisor.stop_signal is None:
            systemd.ready(f"serving http://{args.host}:{args.port}", frontend)
        logger.info(
            "ready in %.1fs: http://%s:%d (%d API worker%s); direct clients: %s",
            time.monotonic() - started,
            args.host,
            args.port,
            args.api_workers,
            "s" if args.api_workers > 1 else "",
            ", ".join(frontends + ([args.frontend] if curve else [])),
        )
        while True:
            dead = supervisor.watch(engines.restarts.next_due())
            if dead is None and supervisor.stop_signal is None:  # a replica's restart is due
                engines.restart_due()
                continue
            if dead is not None and dead.role is Role.ENGINE and engines.exited(dead):
                continue  # the other replicas serve on; this one restarts (or stays down)
            break
        if dead is None:
            systemd.stopping("draining in-flight requests")
            supervisor.drain(args.shutdown_timeout)
            status = 0
        else:
            logger.error("%s exited unexpectedly (exit code %s); stopping the server", dead.name, dead.process.exitcode)
            systemd.failed(f"{dead.name} exited unexpectedly; stopping")
            supervisor.fail()
            status = 1
    finally:
        systemd.close()
        supervisor.kill_remaining()
        if cluster is not None:
            cluster.close()
        shutil.rmtree(runtime_dir, ignore_errors=True)
    logger.info("stopped (exit %d)", status)
    return status


def _ray_replicas(args, supervisor: Supervisor, config):
    """The Ray backend's replicas (api_proc/ray_replicas.py): a local cluster unless --ray-address
    names one, per-launch CURVE keys for the engines' tcp links, and tcp addresses the tokenizer
    process binds. Returns (the local cluster or None, the replicas, the keys)."""
    from pagoda.api_proc.engine_replicas import EngineReplicas
    from pagoda.api_proc.ray_replicas import (
        LocalRayCluster,
        RaySettings,
        engine_link_addrs,
        launch_namespace,
        node_ip,
        run_ray_replica,
    )
    from pagoda.engine_core.zmq_security import EngineLinkKeys

    try:
        import ray  # noqa: F401 - only to fail early and clearly
    except ImportError:
        raise ValueError("--distributed-executor-backend ray needs Ray: pip install 'pagoda-llm[ray]'") from None
    cluster = None if args.ray_address else LocalRayCluster()
    address, auth_env = (args.ray_address, {}) if cluster is None else (cluster.address, cluster.auth_env)
    settings = RaySettings(address, args.ray_cpus_per_rank, args.ray_placement_timeout, launch_namespace(), auth_env)
    keys = EngineLinkKeys.generate()
    # A local cluster's engines connect over loopback; a real one's from other machines.
    addrs = engine_link_addrs(args.data_parallel_size, node_ip() if args.ray_address else "127.0.0.1")
    try:
        engines = EngineReplicas(
            supervisor,
            run_ray_replica,
            config,
            args.data_parallel_size,
            args.max_replica_restarts,
            addrs=addrs,
            target_args=(keys, settings),
        )
    except BaseException:
        if cluster is not None:
            cluster.close()
        raise
    return cluster, engines, keys
