"""How the server's child processes live and die with the `pagoda serve` parent.

Each child (a `Role`) gets one end of a pipe to the parent (`ParentLink`). Over it the child sends
`Report`s (ready, serving) and receives `Command`s (serve, drain, fail, stop); when the pipe reaches
EOF the parent is gone (even by SIGKILL), and the child cleans up and exits at once. A parent-death
signal is armed as a backstop. Messages are msgpack, like everything else that crosses a process boundary.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

import msgspec

from pagoda.engine_core.environment import export_log_settings, log_settings

logger = logging.getLogger(__name__)


class Role(str, enum.Enum):
    """What a child process of `pagoda serve` is; its process is named "pagoda-<role>"."""

    ENGINE = "engine"
    DETOK = "detok"
    API = "api"

    def process_name(self, index: int | None = None) -> str:
        """ "pagoda-engine"; a data-parallel replica's adds its index ("pagoda-engine1", 15 bytes at most)."""
        return f"pagoda-{self.value}" if index is None else f"pagoda-{self.value}{index}"

    def process_title(self, index: int | None = None) -> str:
        """The command line `ps -o args`, `top -c` and systemd show: "pagoda: engine_core",
        "pagoda: engine_core 1" (a data-parallel replica), "pagoda: detok", "pagoda: api 0"."""
        word = {"engine": "engine_core"}.get(self.value, self.value)
        return f"pagoda: {word}" if index is None else f"pagoda: {word} {index}"


class Command(str, enum.Enum):
    """Parent -> child."""

    SERVE = "serve"  # API workers: every process is ready, /health may answer 200
    DRAIN = "drain"  # API workers: accept nothing new, finish in-flight requests, exit 0
    FAIL = "fail"  # API workers: a sibling died; end in-flight requests with an error, exit 1
    STOP = "stop"  # engine and tokenizer process: exit now
    # Tokenizer process: an engine replica's process has exited (info: index, restarting, message);
    # its requests fail now, and it is not sent any until its restarted process reports ready.
    REPLICA_DOWN = "replica_down"


class Report(str, enum.Enum):
    """Child -> parent."""

    READY = "ready"  # started (model loaded, sockets bound)
    SERVING = "serving"  # an API worker's /health answers 200 now
    REPLICA_STALLED = "replica_stalled"  # tokenizer process: kill (and restart) engine replica `index`


_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def configure_logging(level: str, log_format: str | None = None) -> None:
    """The format every process logs in (text or json); children inherit the level and format
    (engine_core/environment.py)."""
    from pagoda.engine_core.log_format import formatter

    log_format = log_format or log_settings()[1]
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(log_format))
    export_log_settings(level, log_format)
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def init_child_process(name: str, title: str) -> None:
    """First thing in every child: a process name `ps`/`top` show (e.g. "pagoda-engine") and a title
    in place of the command line (`Role.process_title`), the parent's log settings, and death with the
    parent."""
    name_process(name, title)
    configure_logging(log_settings()[0])
    started_by = multiprocessing.parent_process()  # (the process that started this one: spawn records it)
    die_with_parent(parent=started_by.pid if started_by is not None else None)


def name_process(name: str, title: str | None = None) -> None:
    """The name `ps -o comm`, `top` and `pgrep` show for this process (15 bytes at most), and with
    `title` its command line (`ps -o args`, /proc/PID/cmdline), which otherwise reads `python -c from
    multiprocessing.spawn import spawn_main...` for every child alike."""
    if title is not None:
        import setproctitle  # (it also sets the short name, to the title's first 15 bytes: named below)

        setproctitle.setproctitle(title)
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15])
    except (OSError, AttributeError):
        pass


def freeze_startup_heap() -> None:
    """Take what start-up allocated (modules, the model, the tokenizer: millions of objects that live as
    long as the process) out of the garbage collector's reach, once a process is ready to serve. A full
    collection otherwise walks all of it: in the engine process those took 110-190 ms, a few times a
    minute under load, and each one stalled every running request's next token (docs/decode-speed.md)."""
    gc.collect()
    gc.freeze()


def die_with_parent(signum: int = signal.SIGTERM, parent: int | None = None) -> None:
    """`signum` to this process when its parent dies (Linux); where `parent` (the pid that started this
    process) is gone already, at once. A process with nothing to clean up can ask for SIGKILL, which no
    inherited disposition stops: an ignored signal stays ignored across fork and exec, and an engine under
    `pagoda serve` ignores SIGTERM (its parent decides when it stops). Without `parent`, only a parent that
    dies while this call runs is noticed: one that died during this process's imports has already handed it
    to another (init or a subreaper), whose pid os.getppid() then returns."""
    parent = os.getppid() if parent is None else parent
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)


class ParentLink:
    """The child's end of its control pipe."""

    def __init__(self, conn: Connection, runtime_dir: str | None = None, socket_files: Sequence[str] = ()):
        self.conn = conn
        # Removed if the parent dies without cleaning up: its runtime directory, and any ipc socket
        # this process bound outside it.
        self.runtime_dir = runtime_dir
        self.socket_files = list(socket_files)
        self._send_lock = threading.Lock()
        # Held by the first caller of `orphaned` until the exit (see there).
        self._orphaned_once = threading.Lock()

    def send(self, kind: Report, **info) -> None:
        with self._send_lock:
            try:
                self.conn.send_bytes(msgspec.msgpack.encode([kind, info]))
            except OSError:  # the parent is gone; the watcher thread handles that
                pass

    def watch(self, on_command: Callable[[Command, dict], None]) -> None:
        """Start a daemon thread that passes each command and its info to `on_command` (from that
        thread) and exits the process when the parent goes away."""
        threading.Thread(target=self._watch, args=(on_command,), name="parent-link", daemon=True).start()

    def _watch(self, on_command: Callable[[Command, dict], None]) -> None:
        while True:
            try:
                kind, info = msgspec.msgpack.decode(self.conn.recv_bytes())
            except (EOFError, OSError):
                self.orphaned()
                return
            on_command(Command(kind), info)

    def orphaned(self) -> None:
        """The parent died without stopping us: remove what it would have removed, and exit now.

        Two threads may get here at once: the watcher at the pipe's end, and the main thread in the
        parent-death signal's handler (where a process installs one). Only the first cleans up; a later
        call returns at once and leaves the exit to the first. (A second clean-up could race the first
        and exit the process halfway through it; the likely cause of a local Ray cluster's actors
        outliving a kill -9 in CI: a second pass finds the raylet already killed and its actors moved to
        init, and its exit cuts the first pass off before that one has killed them.)"""
        if not self._orphaned_once.acquire(blocking=False):
            return
        logger.warning("the pagoda serve parent is gone; exiting")
        self.release_when_orphaned()
        if self.runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        for path in self.socket_files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        os._exit(0)

    def release_when_orphaned(self) -> None:
        """What this process releases itself when the parent is gone, before the runtime directory goes and
        the process exits (a subclass's: Ray actors, a local cluster). Nothing here."""


class ChildLink:
    """The parent's end of one child's control pipe."""

    def __init__(self, name: str, conn: Connection):
        self.name = name
        self.conn = conn

    def send(self, kind: Command, **info) -> None:
        try:
            self.conn.send_bytes(msgspec.msgpack.encode([kind, info]))
        except OSError:
            pass  # the child is gone; the process monitor notices

    def recv(self) -> tuple[Report, dict]:
        kind, info = msgspec.msgpack.decode(self.conn.recv_bytes())
        return Report(kind), info
