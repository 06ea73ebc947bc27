"""Process lifecycle of `pagoda serve`: start-up health, drain, crashes, kill -9, disconnects."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest

from pagoda.api_proc.bench.local_server import (
    MODEL_NAME,
    PagodaServer,
    alive,
    free_port,
    http,
    process_names,
    wait_until,
)
from pagoda.api_proc.client import EngineClient
from pagoda.engine_core import protocol
from pagoda.engine_core.sampling_params import SamplingParams
from tests.process_checks import kill_9_leaves_nothing


def test_health_is_503_until_the_engine_is_ready(tmp_path):
    port = free_port()
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    process = subprocess.Popen(
        [sys.executable, "-m", "pagoda.api_proc.cli", "serve", "--port", str(port), "--kv-cache-memory", "128MiB"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    statuses = []  # every answer of /health, from the first one the HTTP side gives

    def healthy() -> bool:
        try:
            statuses.append(http("GET", f"http://127.0.0.1:{port}/health", timeout=5)[0])
        except OSError:  # not listening yet
            return False
        return statuses[-1] == 200

    try:
        assert wait_until(healthy, 120.0), statuses
        assert statuses[0] == 503 and statuses[-1] == 200  # the HTTP side is up before the model is
        status, body = http("POST", f"http://127.0.0.1:{port}/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    assert list(tmp_path.iterdir()) == []  # runtime directory removed


def _stream_in_thread(server: PagodaServer, max_tokens: int, outcome: dict) -> tuple[threading.Thread, threading.Event]:
    """A streamed completion of exactly `max_tokens` tokens, read in a thread; the event is set once its
    first chunk has come (the request is running). `outcome` gets "tokens" (the usage reported at the end)
    or "error" (what the stream raised)."""
    first_chunk = threading.Event()

    def read() -> None:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        try:
            for chunk in client.completions.create(
                model=MODEL_NAME,
                prompt="Once upon a time",
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            ):
                first_chunk.set()
                if chunk.usage is not None:
                    outcome["tokens"] = chunk.usage.completion_tokens
        except Exception as exc:  # noqa: BLE001 - the test decides whether an error is what it wants
            outcome["error"] = exc
        finally:
            first_chunk.set()  # (also when it failed before its first chunk: the test must not wait for nothing)

    thread = threading.Thread(target=read)
    thread.start()
    return thread, first_chunk


def test_a_start_refused_for_its_settings_leaves_no_runtime_directory(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "pagoda.api_proc.cli", "serve", "--port", str(free_port()), "--api-key", "short"],
        env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "at least 8 characters" in run.stderr, run.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_sigterm_drains_in_flight_request_then_exits_0(tmp_path):
    server = PagodaServer(tmp_path)
    outcome: dict = {}
    thread, first_chunk = _stream_in_thread(server, 200, outcome)
    assert first_chunk.wait(60) and not outcome  # the request is running
    children = server.children()
    server.process.send_signal(signal.SIGTERM)
    # draining: not taking new work, while the request goes on
    assert wait_until(lambda: http("GET", server.base_url + "/health")[0] == 503, 10.0)
    status, body = http("POST", server.base_url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 503 and body["error"]["code"] == "server_shutting_down"
    assert thread.is_alive()  # (the checks above happened while the request was in flight)
    thread.join(60)
    assert outcome == {"tokens": 200}
    assert server.process.wait(30) == 0
    assert wait_until(lambda: not any(alive(pid) for pid in children), 2.0)
    assert server.runtime_dirs() == [] and not (tmp_path / "frontend.sock").exists()
    server.stop()


def test_kill_9_of_the_parent_leaves_nothing_behind(tmp_path):
    server = PagodaServer(tmp_path)
    # engine, detok, api (and multiprocessing's resource tracker)
    assert {"pagoda-engine", "pagoda-detok", "pagoda-api"} <= set(process_names(server).values())
    kill_9_leaves_nothing(server)
    server.stop()


def test_engine_death_fails_requests_and_exits_nonzero_promptly(tmp_path):
    server = PagodaServer(tmp_path)
    outcome: dict = {}
    thread, first_chunk = _stream_in_thread(server, 2000, outcome)
    assert first_chunk.wait(60) and not outcome  # the request is running
    children = server.children()
    os.kill(server.child_named("pagoda-engine"), signal.SIGKILL)
    assert server.process.wait(60) != 0  # (the parent watches its children: it need not wait to notice)
    thread.join(10)
    assert not thread.is_alive() and "error" in outcome and "tokens" not in outcome  # any error, not a hang
    assert wait_until(lambda: not any(alive(pid) for pid in children), 2.0)
    assert server.runtime_dirs() == []
    server.stop()


def test_stalled_engine_turns_health_503(tmp_path):
    server = PagodaServer(tmp_path, "--engine-stall-timeout", "2")
    engine = server.child_named("pagoda-engine")
    try:
        os.kill(engine, signal.SIGSTOP)
        assert wait_until(lambda: http("GET", server.base_url + "/health")[0] == 503, 6.0, 0.2)
        _status, body = http("GET", server.base_url + "/health")
        assert "stalled" in body["message"]
    finally:
        os.kill(engine, signal.SIGCONT)
    assert wait_until(lambda: http("GET", server.base_url + "/health")[0] == 200, 5.0, 0.2)
    assert server.stop() == 0


def test_disconnects_free_the_request_and_curve_tcp_frontend(tmp_path):
    """Two API workers share the port; clients that vanish (streaming or not) have their requests
    aborted; a tcp:// frontend admits only CURVE-authenticated direct clients."""
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "pagoda.api_proc.cli", "keys", str(keys)], check=True, capture_output=True)
    tcp_port = free_port()
    server = PagodaServer(
        tmp_path, "--api-workers", "2", "--frontend", f"tcp://127.0.0.1:{tcp_port}", "--curve-keys", str(keys)
    )
    try:
        assert len([p for p in server.children() if Path(f"/proc/{p}/comm").read_text().strip() == "pagoda-api"]) == 2
        direct = EngineClient(
            f"tcp://127.0.0.1:{tcp_port}", curve=(str(keys / "server.key"), str(keys / "client.key_secret"))
        )
        deltas = list(direct.generate("Hi", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), timeout=30))
        assert len([t for d in deltas for t in protocol.unpack_tokens(d.tokens)]) == 3
        _, over_http = http(
            "POST",
            server.base_url + "/v1/completions",
            {"prompt": "Hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True},
        )
        assert "".join(d.text for d in deltas) == over_http["choices"][0]["text"]
        for stream in (True, False):
            body = (
                b'{"prompt": "Tell me a story", "max_tokens": 1500, "ignore_eos": true, "stream": '
                + (b"true" if stream else b"false")
                + b"}"
            )
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                assert wait_until(lambda: direct.health().num_running == 1, 10.0, 0.1)
            # the socket is closed: within a step or so the engine has nothing running and no blocks
            assert wait_until(lambda: direct.health().num_running == 0, 5.0, 0.1), stream
            assert wait_until(lambda: direct.health().kv_cache_usage == 0.0, 2.0, 0.1)
        direct.close()
        stranger_keys = tmp_path / "stranger"
        subprocess.run(
            [sys.executable, "-m", "pagoda.api_proc.cli", "keys", str(stranger_keys)], check=True, capture_output=True
        )
        stranger = EngineClient(
            f"tcp://127.0.0.1:{tcp_port}", curve=(str(keys / "server.key"), str(stranger_keys / "client.key_secret"))
        )
        with pytest.raises(TimeoutError):
            stranger.health(timeout=2.0)
        stranger.close()
    finally:
        assert server.stop() == 0
