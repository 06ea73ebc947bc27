"""`pagoda serve` under systemd: sd_notify messages from a real server to a real unix datagram socket
standing in for systemd's, and `--config pagoda.yaml`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from pagoda.api_proc.bench.local_server import PagodaServer, free_port, http, wait_until
from pagoda.api_proc.client import EngineClient
from pagoda.api_proc.sd_notify import Notifier, SystemdService, watchdog_period


class NotifySocket:
    """Collects the assignments (`READY=1`, ...) of every datagram sent to a unix socket, in order."""

    def __init__(self, address: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(0.1)
        self.received: list[tuple[float, str]] = []  # (monotonic time, assignment)
        self._closed = False
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        while not self._closed:
            try:
                datagram = self.sock.recv(4096)
            except (TimeoutError, OSError):
                continue
            now = time.monotonic()
            self.received += [(now, line) for line in datagram.decode().split("\n") if line]

    def lines(self, start: int = 0) -> list[str]:
        return [line for _, line in self.received[start:]]

    def wait_for(self, line: str, timeout: float, start: int = 0) -> bool:
        return wait_until(lambda: line in self.lines(start), timeout)

    def seconds_since_last(self, line: str) -> float:
        times = [t for t, received in self.received if received == line]
        return time.monotonic() - times[-1] if times else float("inf")

    def close(self) -> None:
        self._closed = True
        self._thread.join()
        self.sock.close()


class ServerNotWaitedFor(PagodaServer):
    """A PagodaServer whose start does not wait for /health: the test waits for READY=1 instead."""

    def wait_healthy(self, timeout: float) -> None:
        pass


def test_notifier_protocol_path_abstract_and_unset(tmp_path):
    """One datagram of newline-separated assignments; "@name" is the abstract namespace; no socket, no-op."""
    for address in (str(tmp_path / "n.sock"), f"@pagoda-test-{os.getpid()}"):
        listener = NotifySocket(address)
        try:
            assert Notifier(address).send("READY=1", "STATUS=serving")
            assert wait_until(lambda listener=listener: listener.lines() == ["READY=1", "STATUS=serving"], 5.0)
        finally:
            listener.close()
    assert not Notifier(None).send("READY=1")
    environ = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}
    assert watchdog_period(environ, os.getpid()) is None  # meant for another process
    assert watchdog_period({**environ, "WATCHDOG_PID": str(os.getpid())}, os.getpid()) == 2.0
    assert watchdog_period({}, os.getpid()) is None
    environ = {"NOTIFY_SOCKET": str(tmp_path / "n.sock"), "WATCHDOG_USEC": "2000000", "PATH": "/bin"}
    SystemdService(environ)
    assert environ == {"PATH": "/bin"}  # the children must not inherit them


def test_ready_watchdog_follows_the_engine_loop_then_stopping(tmp_path, monkeypatch):
    listener = NotifySocket(str(tmp_path / "notify.sock"))
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")  # 2 s: a ping a second; none after 1.5 s without progress
    server = ServerNotWaitedFor(tmp_path)
    engine = None
    try:
        assert listener.wait_for("READY=1", 120), server.log()
        assert http("GET", server.base_url + "/health")[0] == 200  # READY=1 means /health answers 200
        assert listener.wait_for("WATCHDOG=1", 5.0)
        engine = server.child_named("pagoda-engine")
        assert b"NOTIFY_SOCKET" not in Path(f"/proc/{engine}/environ").read_bytes()

        os.kill(engine, signal.SIGSTOP)  # HTTP still answers; the engine loop does not run
        assert wait_until(lambda: listener.seconds_since_last("WATCHDOG=1") > 3.0, 15.0), (
            "watchdog pings went on while the engine was stopped"
        )
        assert http("GET", server.base_url + "/v1/models")[0] == 200  # pings depend on the engine, not HTTP
        resumed_from = len(listener.received)
        os.kill(engine, signal.SIGCONT)
        engine = None
        assert listener.wait_for("WATCHDOG=1", 10.0, start=resumed_from)
    finally:
        if engine is not None:
            os.kill(engine, signal.SIGCONT)
        assert server.stop() == 0
        listener.close()
    lines = listener.lines()
    ready, stopping = lines.index("READY=1"), lines.index("STOPPING=1")
    pings = [i for i, line in enumerate(lines) if line == "WATCHDOG=1"]
    assert ready < pings[0] and pings[-1] < stopping  # READY=1, WATCHDOG=1 ..., STOPPING=1
    assert any(line.startswith("STATUS=") for line in lines)


def test_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    port = free_port()
    frontend = f"ipc://{tmp_path}/frontend.sock"
    config = tmp_path / "pagoda.yaml"
    config.write_text(
        f"port: {port}\nserved-model-name: [file-a, file-b]\nmax_num_seqs: 2\n"
        f"max-model-len: 512\nkv-cache-memory: 256MiB\nfrontend: {frontend}\nshutdown-timeout: 1\n"
    )
    (tmp_path / "run").mkdir()
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    command = [sys.executable, "-m", "pagoda.api_proc.cli", "serve", "--config", str(config)]

    bad = tmp_path / "bad.yaml"
    bad.write_text("max-num-seq: 2\nport: 1\n")
    result = subprocess.run(command[:-1] + [str(bad)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "unknown key: max-num-seq (did you mean max-num-seqs?)" in result.stderr

    process = subprocess.Popen(
        command + ["--max-model-len", "384"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    base_url = f"http://127.0.0.1:{port}"
    threads = []
    try:
        assert wait_until(lambda: process.poll() is None and _status(base_url + "/health") == 200, 120.0)
        _, body = http("GET", base_url + "/v1/models")
        assert [m["id"] for m in body["data"]] == ["file-a", "file-b"]
        assert body["data"][0]["max_model_len"] == 384  # the command line beat the file's 512

        # max-num-seqs: 2 from the file: of three long requests, two run and one waits (until the
        # file's 1 s shutdown timeout ends them)
        request = {"model": "file-a", "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True}
        threads = [
            threading.Thread(target=http, args=("POST", base_url + "/v1/completions", request)) for _ in range(3)
        ]
        for thread in threads:
            thread.start()
        direct = EngineClient(frontend)

        def running_and_waiting() -> tuple[int, int]:
            report = direct.health()
            return report.num_running, report.num_waiting

        try:
            assert wait_until(lambda: running_and_waiting() == (2, 1), 30.0, 0.05)
        finally:
            direct.close()
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        for thread in threads:
            thread.join(60)


def _status(url: str) -> int:
    try:
        return http("GET", url, timeout=2)[0]
    except OSError:
        return 0
