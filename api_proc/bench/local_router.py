"""A real `pagoda router` process on this machine, for tests and benchmarks: started as a user would, on a
free port, in front of the given backends; stopped with SIGTERM (its exit status is what `stop` returns)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pagoda.api_proc.bench.local_server import free_port, http


class LocalRouter:
    def __init__(
        self,
        log_dir: Path,
        backends: list[str],
        *extra_args: str,
        ready_timeout: float = 60.0,
        env: dict[str, str] | None = None,
    ):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"router-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - the router writes to it until stop()
        args = [arg for url in backends for arg in ("--backend", url)]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pagoda.api_proc.cli", "router", "--port", str(self.port), *args, *extra_args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=None if env is None else {**os.environ, **env},
        )
        self._wait_listening(ready_timeout)

    def _wait_listening(self, timeout: float) -> None:
        """Until the router answers /health at all (503 too: its backends may all be down on purpose)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"router exited with {self.process.returncode}:\n{self.log()}")
            try:
                http("GET", self.base_url + "/health", timeout=2)
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"router not listening after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict:
        return http("GET", self.base_url + "/health", timeout=10)[1]

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode
