"""A real `pagoda serve` on this machine, for tests and benchmarks: started as a user would, on a free
port, stopped cleanly; and what they measure of its processes (children, CPU time, memory)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pagoda.engine_core.identity import DEFAULT_SERVED_MODEL_NAME

MODEL_NAME = DEFAULT_SERVED_MODEL_NAME  # the name the default model is served as


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CODE_FOLDERS = ("api_proc", "detok_proc", "engine_core", "kernels")


def import_tree(checkout: Path, where: Path) -> Path:
    """A directory to put on PYTHONPATH so that `pagoda.*` imports from `checkout`'s four code folders
    (links pagoda/<folder> -> checkout/<folder>, as the installed package maps them): ahead on sys.path,
    it wins over the editable install's import hook. Checkouts from before 0.3.0 import their folders by
    their bare names and need an environment of their own."""
    if not (checkout / "kernels" / "ops.py").exists():
        raise ValueError(f"{checkout} predates the pagoda.* import names (0.3.0): it cannot run in this environment")
    package = where / "pagoda"
    package.mkdir(parents=True, exist_ok=True)
    for folder in CODE_FOLDERS:
        link = package / folder
        if not link.is_symlink():
            link.symlink_to(checkout.resolve() / folder, target_is_directory=True)
    return where


def http(
    method: str, url: str, body: bytes | dict | None = None, timeout: float = 60.0, headers: dict | None = None
) -> tuple[int, dict | str]:
    """(status, parsed JSON or text) for one raw HTTP request; never raises on an error status."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def wait_until(condition, timeout: float, interval: float = 0.05) -> bool:
    """Poll `condition` until it holds or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


class PagodaServer:
    def __init__(
        self,
        tmp_path: Path,
        *extra_args: str,
        ready_timeout: float = 120.0,
        remove_dir_on_stop: bool = False,
        source_dir: Path | None = None,
    ):
        """`source_dir`: run the server from this checkout (e.g. an older commit's worktree) instead of
        the installed code."""
        self.tmp_path = tmp_path
        self.remove_dir_on_stop = remove_dir_on_stop  # benchmarks own their directory; pytest owns tests'
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.frontend = f"ipc://{tmp_path}/frontend.sock"
        self.log_path = tmp_path / "server.log"
        self.runtime_root = tmp_path / "run"
        self.runtime_root.mkdir(exist_ok=True)
        env = {**os.environ, "XDG_RUNTIME_DIR": str(self.runtime_root)}
        if source_dir is not None:
            env["PYTHONPATH"] = str(import_tree(source_dir, tmp_path / "source-imports"))
        # A test reads /metrics right after what it counts: a fresh render for every scrape, not the text
        # of up to a second ago (a later --metrics-interval in `extra_args` wins). An older checkout
        # (`source_dir`) may not know the flag.
        fresh_metrics = ["--metrics-interval", "0"] if source_dir is None else []
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - the server writes to it until stop()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagoda.api_proc.cli",
                "serve",
                "--port",
                str(self.port),
                "--kv-cache-memory",
                "256MiB",
                "--frontend",
                self.frontend,
                *fresh_metrics,
                *extra_args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=source_dir,
        )
        self.wait_healthy(ready_timeout)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                status, _ = http("GET", self.base_url + "/health", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[int]:
        return child_pids(self.process.pid)

    def child_named(self, name: str) -> int:
        for pid in self.children():
            try:
                if (
                    name in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                    or Path(f"/proc/{pid}/comm").read_text().strip() == name
                ):
                    return pid
            except OSError:
                continue
        raise LookupError(name)

    def model_dir(self) -> Path:
        from pagoda.engine_core.default_model import ensure_default_model

        return ensure_default_model()

    def runtime_dirs(self) -> list[Path]:
        return list(self.runtime_root.iterdir())

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        if self.remove_dir_on_stop:
            shutil.rmtree(self.tmp_path, ignore_errors=True)
        return self.process.returncode


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def process_names(server: PagodaServer) -> dict[int, str]:
    """pid -> name of the server's parent ("parent") and each of its children (pagoda-engine, ...)."""
    names = {server.process.pid: "parent"}
    for pid in server.children():
        names[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
    return names
