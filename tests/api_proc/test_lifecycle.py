"""Process lifecycle of `pagoda serve`: start-up health, drain, crashes, kill -9, disconnects."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest

from api_proc.client import EngineClient
from engine_core.sampling_params import SamplingParams
from api_proc.bench.local_server import MODEL_NAME, PagodaServer, alive, free_port, http, wait_until


def test_health_is_503_until_the_engine_is_ready(tmp_path):
    port = free_port()
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    process = subprocess.Popen([sys.executable, "-m", "api_proc.cli", "serve", "--port", str(port),
                                "--kv-cache-memory", "128MiB"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    statuses = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and 200 not in statuses:
            try:
                statuses.append(http("GET", f"http://127.0.0.1:{port}/health", timeout=5)[0])
            except OSError:
                pass
            time.sleep(0.05)
        assert statuses[0] == 503 and statuses[-1] == 200  # the HTTP side is up before the model is
        status, body = http("POST", f"http://127.0.0.1:{port}/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    assert list(tmp_path.iterdir()) == []  # runtime directory removed


def test_sigterm_drains_in_flight_request_then_exits_0(tmp_path):
    server = PagodaServer(tmp_path)
    result = {}

    def long_request():
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        r = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=80, temperature=0,
                                      extra_body={"ignore_eos": True})
        result["tokens"] = r.usage.completion_tokens

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)  # the request is running
    children = server.children()
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert http("GET", server.base_url + "/health")[0] == 503  # draining: not taking new work
    status, body = http("POST", server.base_url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 503 and body["error"]["code"] == "server_shutting_down"
    thread.join(60)
    assert result == {"tokens": 80}
    assert server.process.wait(30) == 0
    assert wait_until(lambda: not any(alive(pid) for pid in children), 2.0)
    assert server.runtime_dirs() == [] and not (tmp_path / "frontend.sock").exists()
    server.stop()


def test_kill_9_of_the_parent_leaves_nothing_behind(tmp_path):
    server = PagodaServer(tmp_path)
    children = server.children()
    assert len(children) >= 3  # engine, detok, api (and multiprocessing's resource tracker)
    server.process.kill()
    server.process.wait()
    assert wait_until(lambda: not any(alive(pid) for pid in children), 2.0), \
        [open(f"/proc/{p}/comm").read() for p in children if alive(p)]
    assert wait_until(lambda: server.runtime_dirs() == [], 1.0)
    assert not (tmp_path / "frontend.sock").exists()
    server.stop()


def test_engine_death_fails_requests_and_exits_nonzero_promptly(tmp_path):
    server = PagodaServer(tmp_path)
    errors = []

    def streaming_request():
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        try:
            for _ in client.completions.create(model=MODEL_NAME, prompt="Once", max_tokens=2000, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
                pass
        except Exception as exc:  # noqa: BLE001 - any error is what we want, a hang is not
            errors.append(exc)

    thread = threading.Thread(target=streaming_request)
    thread.start()
    time.sleep(1.0)
    children = server.children()
    os.kill(server.child_named("pagoda-engine"), signal.SIGKILL)
    killed = time.monotonic()
    assert server.process.wait(10) != 0
    assert time.monotonic() - killed < 2.5
    thread.join(10)
    assert not thread.is_alive() and errors
    assert wait_until(lambda: not any(alive(pid) for pid in children), 2.0)
    assert server.runtime_dirs() == []
    server.stop()


def test_stalled_engine_turns_health_503(tmp_path):
    server = PagodaServer(tmp_path, "--engine-stall-timeout", "2")
    engine = server.child_named("pagoda-engine")
    try:
        os.kill(engine, signal.SIGSTOP)
        assert wait_until(lambda: http("GET", server.base_url + "/health")[0] == 503, 6.0, 0.2)
        status, body = http("GET", server.base_url + "/health")
        assert "stalled" in body["message"]
    finally:
        os.kill(engine, signal.SIGCONT)
    assert wait_until(lambda: http("GET", server.base_url + "/health")[0] == 200, 5.0, 0.2)
    assert server.stop() == 0


def test_disconnects_free_the_request_and_curve_tcp_frontend(tmp_path):
    """Two API workers share the port; clients that vanish (streaming or not) have their requests
    aborted; a tcp:// frontend admits only CURVE-authenticated direct clients."""
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "api_proc.cli", "keys", str(keys)], check=True, capture_output=True)
    tcp_port = free_port()
    server = PagodaServer(tmp_path, "--api-workers", "2", "--frontend", f"tcp://127.0.0.1:{tcp_port}",
                          "--curve-keys", str(keys))
    try:
        assert len([p for p in server.children() if open(f"/proc/{p}/comm").read().strip() == "pagoda-api"]) == 2
        direct = EngineClient(f"tcp://127.0.0.1:{tcp_port}",
                              curve=(str(keys / "server.key"), str(keys / "client.key_secret")))
        ids = [d.text for d in direct.generate("Hi", SamplingParams(max_tokens=3, temperature=0), timeout=30)]
        assert len(ids) >= 1
        for stream in (True, False):
            body = (b'{"prompt": "Tell me a story", "max_tokens": 1500, "ignore_eos": true, "stream": '
                    + (b"true" if stream else b"false") + b"}")
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                assert wait_until(lambda: direct.health().num_running == 1, 10.0, 0.1)
            # the socket is closed: within a step or so the engine has nothing running and no blocks
            assert wait_until(lambda: direct.health().num_running == 0, 5.0, 0.1), stream
            assert wait_until(lambda: direct.health().kv_cache_usage == 0.0, 2.0, 0.1)
        direct.close()
        stranger_keys = tmp_path / "stranger"
        subprocess.run([sys.executable, "-m", "api_proc.cli", "keys", str(stranger_keys)], check=True,
                       capture_output=True)
        stranger = EngineClient(f"tcp://127.0.0.1:{tcp_port}",
                                curve=(str(keys / "server.key"), str(stranger_keys / "client.key_secret")))
        with pytest.raises(TimeoutError):
            stranger.health(timeout=2.0)
        stranger.close()
    finally:
        assert server.stop() == 0
