"""`pagoda router` in front of real `pagoda serve` backends (a tiny random-weight model, so they serve in
milliseconds), every one a real process: P2C steers around a stopped backend where round robin sends it a
third, health checks eject and re-admit, a backend killed mid-stream ends its streams with an error event
while new requests go elsewhere, the prefix policy keeps a prefix on one backend, the router's keys and
limits, and streamed text through the router equal to the backend's own. The choices themselves (pure
functions of the backends' state) are checked directly first."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import openai
import psutil
import pytest

from pagoda.api_proc.bench.local_router import LocalRouter
from pagoda.api_proc.bench.local_server import PagodaServer, alive, child_pids, free_port, http, wait_until
from pagoda.api_proc.router.backends import Backend, BackendLoad, BackendPool
from pagoda.api_proc.router.metrics import RouterMetrics
from pagoda.api_proc.router.policies import PREFIX_CHARS, Picker, prefix_key, rendezvous
from pagoda.api_proc.router.settings import RouterSettings
from tests import tiny_models
from tests.metrics_scrape import Scrape, scrape_until

MODEL = "tiny"
BACKEND_KEY = "backend-key-0123"  # the backends' own key: only the router holds it
ROUTER_KEY = "router-key-4567"
REQUESTS = "pagoda_router_backend_requests_total"
# The backends: the tiny model, one thread each, a small KV pool; a stall timeout far above any SIGSTOP
# here, so that a stopped-then-continued backend is not taken for a hung one.
BACKEND_FLAGS = (
    "--served-model-name",
    MODEL,
    "--api-key",
    BACKEND_KEY,
    "--num-threads",
    "1",
    "--kv-cache-memory",
    "16MiB",
    "--engine-stall-timeout",
    "600",
)


# ---- the choices, directly ---------------------------------------------------------------------------
def _backends(*in_flight: int) -> list[Backend]:
    return [Backend(f"http://10.0.0.{i}:8000", i, in_flight=n) for i, n in enumerate(in_flight)]


def test_p2c_takes_the_less_loaded_of_two_and_round_robin_goes_in_turn():
    picker = Picker("p2c", seed=0)
    loaded = _backends(0, 5)
    assert {picker.pick(loaded).index for _ in range(50)} == {0}  # of two, always the idle one
    loaded[1].load = BackendLoad(running=0, waiting=0, kv_cache_usage=0.0)
    loaded[0].load = BackendLoad(running=7, waiting=3, kv_cache_usage=0.5)  # others' traffic counts
    assert {picker.pick(loaded).index for _ in range(50)} == {1}
    three = _backends(0, 0, 0)
    assert {picker.pick(three).index for _ in range(100)} == {0, 1, 2}
    rr = Picker("round_robin")
    assert [rr.pick(three).index for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [rr.pick([three[0], three[2]]).index for _ in range(3)] == [2, 0, 2]  # 1 ejected: skipped


def test_prefix_keys_and_rendezvous_hashing():
    long = "You are a helpful assistant. " * 60
    assert prefix_key(b'{"prompt": "abc", "max_tokens": 3}') == b"abc"
    assert prefix_key(json.dumps({"prompt": long + " tail"}).encode()) == long[:PREFIX_CHARS].encode()
    assert prefix_key(b'{"prompt": [[5, 6, 7], [8]]}') == b"5,6,7"  # a batch: its first prompt
    chat = b'{"messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}]}'
    assert prefix_key(chat) == b"system: Be brief.\n"
    assert prefix_key(b'{"model": "x"}') is None and prefix_key(b"not json") is None
    assert prefix_key(b"[" * 100 + b"]" * 100) is None  # too deep to parse: the backend's 400 to give
    backends = _backends(0, 0, 0, 0)
    keys = [f"prompt {i}".encode() for i in range(400)]
    homes = [rendezvous(k, backends).index for k in keys]
    assert all(homes.count(i) > 60 for i in range(4)), homes  # spread over all four
    without_2 = [rendezvous(k, [b for b in backends if b.index != 2]).index for k in keys]
    moved = [(a, b) for a, b in zip(homes, without_2, strict=True) if a != b]
    assert moved and all(a == 2 for a, _ in moved)  # only backend 2's prefixes move when it goes
    picker = Picker("prefix", seed=0)
    home = rendezvous(b"shared", backends)
    assert {picker.pick(backends, b"shared").index for _ in range(20)} == {home.index}
    home.in_flight = 200  # SGLang's imbalance test: > 64 above the least loaded and > 1.5x it
    assert home.index not in {picker.pick(backends, b"shared").index for _ in range(50)}


def test_failures_in_a_row_eject_and_only_a_probe_readmits():
    settings = RouterSettings(backends=("http://10.0.0.1:8000", "http://10.0.0.2:8000"), eject_after_failures=3)
    metrics = RouterMetrics(settings.backends)
    pool = BackendPool(settings, metrics, session=None)  # type: ignore[arg-type]  (no probe is sent here)
    first = pool.backends[0]
    pool.failed(first, "connect", "refused")
    pool.failed(first, "timeout", "slow")
    pool.succeeded(first)  # an answer in between: the count starts again
    for _ in range(2):
        pool.failed(first, "connect", "refused")
    assert first.up
    pool.failed(first, "connect", "refused")
    assert not first.up and pool.up() == [pool.backends[1]]
    pool.succeeded(first)  # a late answer to an earlier request does not bring it back
    assert not first.up
    pool._passed_probe(first)
    assert first.up and first.consecutive_failures == 0
    text = metrics.render().decode()
    assert 'pagoda_router_backend_ejections_total{backend="http://10.0.0.1:8000"} 1.0' in text
    assert 'pagoda_router_backend_errors_total{backend="http://10.0.0.1:8000",kind="connect"} 4.0' in text


# ---- real processes ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    out = tmp_path_factory.mktemp("tiny-model")
    tiny_models.save_servable("llama", out, default_model_dir)
    return out


@pytest.fixture(scope="module")
def fleet(start_server, tiny_model_dir, tmp_path_factory):
    """Three backends that live as long as the module (each test leaves them running), and a fourth that
    one test kills: started side by side."""
    victim: list[PagodaServer] = []

    def start_victim() -> PagodaServer:
        victim.append(PagodaServer(tmp_path_factory.mktemp("victim"), "--model", str(tiny_model_dir), *BACKEND_FLAGS))
        return victim[0]

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(start_server, "--model", str(tiny_model_dir), *BACKEND_FLAGS) for _ in range(3)]
        futures.append(pool.submit(start_victim))
        servers = [f.result() for f in futures]
    yield servers
    for server in victim:
        server.stop()


@pytest.fixture()
def start_router(tmp_path):
    """Starts `pagoda router` processes; each must exit 0 on SIGTERM at the end of the test."""
    routers: list[LocalRouter] = []

    def start(backends: list[PagodaServer | str], *flags: str, env: dict[str, str] | None = None) -> LocalRouter:
        urls = [b if isinstance(b, str) else b.base_url for b in backends]
        routers.append(LocalRouter(tmp_path, urls, *flags, env=env))
        return routers[-1]

    yield start
    codes = [router.stop() for router in routers]
    assert codes == [0] * len(routers), [r.log()[-3000:] for r in routers]


def server_pids(server: PagodaServer) -> list[int]:
    """The server's parent first, then every process below it."""
    pids, queue = [server.process.pid], [server.process.pid]
    while queue:
        children = child_pids(queue.pop())
        pids += children
        queue += children
    return pids


class Stopped:
    """SIGSTOP every process of a server for the `with` block, SIGCONT them after, whatever happens."""

    def __init__(self, server: PagodaServer):
        self.pids = server_pids(server)

    def __enter__(self) -> Stopped:
        for pid in self.pids:  # the parent first: it never sees a child stop
            os.kill(pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc) -> None:
        for pid in reversed(self.pids):
            os.kill(pid, signal.SIGCONT)


def complete(base_url: str, prompt: str = "Hello", key: str | None = ROUTER_KEY, timeout: float = 120.0, **extra):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return http("POST", base_url + "/v1/completions", body, timeout=timeout, headers=headers)


def sent_to(router: LocalRouter, server: PagodaServer) -> float:
    return Scrape(router).value(REQUESTS, backend=server.base_url)  # type: ignore[arg-type]


def in_flight(router: LocalRouter, server: PagodaServer) -> float:
    return Scrape(router).value("pagoda_router_backend_in_flight", backend=server.base_url)  # type: ignore[arg-type]


def test_load_is_a_probe_route(fleet):
    status, body = http("GET", fleet[0].base_url + "/load")  # no key, though the backend has one
    assert status == 200 and body == {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}, body
    assert http("GET", fleet[0].base_url + "/v1/models")[0] == 401


def test_streamed_text_through_the_router_equals_direct(fleet, start_router):
    router = start_router(fleet[:3], "--backend-api-key", BACKEND_KEY, "--api-key", ROUTER_KEY)
    via = openai.OpenAI(base_url=router.base_url + "/v1", api_key=ROUTER_KEY, max_retries=0)
    direct = openai.OpenAI(base_url=fleet[0].base_url + "/v1", api_key=BACKEND_KEY, max_retries=0)

    def streamed(client: openai.OpenAI, prompt: str) -> tuple[str, str]:
        params = dict(model=MODEL, max_tokens=24, temperature=0, stream=True)
        text = "".join(c.choices[0].text for c in client.completions.create(prompt=prompt, **params) if c.choices)
        messages = [{"role": "user", "content": prompt}]
        chat = client.chat.completions.create(messages=messages, **params)  # type: ignore[call-overload]
        return text, "".join(c.choices[0].delta.content or "" for c in chat if c.choices)

    for prompt in ("The capital of France is", "Once upon a time", "1, 2, 3,"):
        expected = streamed(direct, prompt)
        assert all(expected)
        for _ in range(3):  # whichever backend answers
            assert streamed(via, prompt) == expected
    reply = via.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0)
    assert reply.choices[0].text == streamed(direct, "Once upon a time")[0]
    assert [m.id for m in via.models.list().data] == [MODEL]


def test_p2c_steers_around_a_stopped_backend(fleet, start_router):
    """Once the stopped backend holds a few requests that never finish, P2C stops choosing it: of the
    requests after that first burst (the issue's "after the first second"), at most 10 % go there."""
    backends = fleet[:3]
    router = start_router(
        backends,
        "--backend-api-key",
        BACKEND_KEY,
        "--api-key",
        ROUTER_KEY,
        "--health-check-interval",
        "600",
        "--eject-after-failures",
        "1000",  # no ejection: P2C alone
    )
    stopped = backends[2]
    with ThreadPoolExecutor(16) as burst, ThreadPoolExecutor(8) as steady, Stopped(stopped):
        first = [burst.submit(complete, router.base_url, f"Burst {i}") for i in range(16)]
        assert wait_until(lambda: sum(f.done() for f in first) + in_flight(router, stopped) == 16, 60, 0.1)
        stuck = in_flight(router, stopped)
        assert stuck >= 1
        before = Scrape(router)
        later = [steady.submit(complete, router.base_url, f"Steady {i}") for i in range(60)]

        def settled() -> bool:
            went_there = sent_to(router, stopped) - before.value(REQUESTS, backend=stopped.base_url)
            return sum(f.done() for f in later) + went_there == 60

        assert wait_until(settled, 60, 0.1)
        after = Scrape(router)
    # SIGCONT: the stuck requests finish too
    assert all(f.result()[0] == 200 for f in first + later)
    shares = [after.value(REQUESTS, backend=b.base_url) - before.value(REQUESTS, backend=b.base_url) for b in backends]
    assert sum(shares) == 60 and shares[2] <= 6, shares


def test_round_robin_sends_a_stopped_backend_its_third_and_those_time_out(fleet, start_router):
    backends = fleet[:3]
    router = start_router(
        backends,
        "--policy",
        "round_robin",
        "--backend-api-key",
        BACKEND_KEY,
        "--api-key",
        ROUTER_KEY,
        "--read-timeout",
        "4",
        "--health-check-interval",
        "600",
        "--eject-after-failures",
        "1000",
    )
    with ThreadPoolExecutor(10) as pool, Stopped(backends[1]):
        results = list(pool.map(lambda i: complete(router.base_url, f"Request {i}"), range(30)))
    timed_out = [body for status, body in results if status == 504]
    assert len(timed_out) == 10 and sum(status == 200 for status, _ in results) == 20, results
    assert {body["error"]["code"] for body in timed_out} == {"backend_timeout"}
    scrape = Scrape(router)
    assert [scrape.value(REQUESTS, backend=b.base_url) for b in backends] == [10, 10, 10]
    assert scrape.value("pagoda_router_backend_errors_total", backend=backends[1].base_url, kind="timeout") == 10


def test_health_checks_eject_a_stopped_backend_and_readmit_it(fleet, start_router):
    backends = fleet[:3]
    router = start_router(
        backends,
        "--backend-api-key",
        BACKEND_KEY,
        "--api-key",
        ROUTER_KEY,
        "--health-check-interval",
        "0.2",
        "--health-check-timeout",
        "2",
        "--eject-after-failures",
        "2",
    )

    def state_of(server: PagodaServer) -> str:
        return next(b["state"] for b in router.health()["backends"] if b["url"] == server.base_url)

    assert router.health()["status"] == "ok"
    with Stopped(backends[0]):
        assert wait_until(lambda: state_of(backends[0]) == "ejected", 30, 0.1)
        health = router.health()
        assert health["status"] == "degraded" and health["backends_up"] == 2
        before = sent_to(router, backends[0])
        assert all(complete(router.base_url, f"While ejected {i}")[0] == 200 for i in range(10))
        assert sent_to(router, backends[0]) == before  # nothing for the ejected one
    assert wait_until(lambda: state_of(backends[0]) == "up", 30, 0.1)
    assert router.health()["status"] == "ok"
    assert Scrape(router).value("pagoda_router_backend_ejections_total", backend=backends[0].base_url) == 1


def test_a_backend_killed_mid_stream(fleet, start_router):
    """Streams it had started end with an error event (no hang), requests after go to the other backend
    (the first ones retried there after a refused connection), and the killed server leaves nothing."""
    victim, survivor = fleet[3], fleet[0]
    router = start_router(
        [victim, survivor],
        "--policy",
        "round_robin",
        "--backend-api-key",
        BACKEND_KEY,
        "--api-key",
        ROUTER_KEY,
        "--health-check-interval",
        "600",
        "--eject-after-failures",
        "3",
    )
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key=ROUTER_KEY, max_retries=0, timeout=60)
    started = threading.Barrier(5, timeout=60)

    def stream(i: int) -> tuple[int, str | None]:
        chunks = client.completions.create(
            model=MODEL,
            prompt=f"Stream {i}",
            max_tokens=900,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        count = 0
        try:
            for _ in chunks:
                count += 1
                if count == 1:
                    started.wait()
        except openai.APIError as exc:
            return count, exc.message
        return count, None

    pids = server_pids(victim)
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream, i) for i in range(4)]
        started.wait()  # every stream has its first chunk: two of them come from the victim
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        _, not_done = wait(streams, timeout=60)
    assert not not_done
    outcomes = [f.result() for f in streams]
    failed = [o for o in outcomes if o[1] is not None]
    assert len(failed) == 2 and all("failed while answering" in message for _, message in failed), outcomes
    assert all(count == 900 for count, error in outcomes if error is None), outcomes
    assert all(complete(router.base_url, f"After {i}")[0] == 200 for i in range(10))
    assert next(b["state"] for b in router.health()["backends"] if b["url"] == victim.base_url) == "ejected"
    scrape = Scrape(router)
    assert scrape.value("pagoda_router_backend_errors_total", backend=victim.base_url, kind="disconnected") == 2
    assert scrape.value("pagoda_router_backend_errors_total", backend=victim.base_url, kind="connect") >= 1
    assert wait_until(lambda: not any(alive(pid) for pid in pids), 10)


def test_a_client_that_leaves_aborts_the_request_on_the_backend(fleet, start_router):
    backend = fleet[0]
    router = start_router([backend], "--backend-api-key", BACKEND_KEY, "--api-key", ROUTER_KEY)
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key=ROUTER_KEY, max_retries=0, timeout=60)
    before = Scrape(backend)
    chunks = client.completions.create(
        model=MODEL, prompt="Leave early", max_tokens=900, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(chunks))
    chunks.close()  # the client hangs up: the router closes its backend connection, an abort there

    def aborted(scrape: Scrape) -> bool:  # (the running gauge moves with the engine's next stats)
        ended = scrape.value("vllm:request_success_total", finished_reason="abort")
        aborts = ended - before.value("vllm:request_success_total", finished_reason="abort")
        return aborts == 1 and scrape.value("vllm:num_requests_running") == 0

    assert aborted(scrape_until(backend, aborted))
    assert wait_until(lambda: in_flight(router, backend) == 0, 10)


def backend_connections(router: LocalRouter, backend: PagodaServer) -> int:
    """The router's open (ESTABLISHED) TCP connections to the backend's port."""
    connections = psutil.Process(router.process.pid).net_connections(kind="tcp")
    return sum(
        1 for c in connections if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port == backend.port
    )


def test_idle_backend_connections_of_a_burst_close_though_load_polls_go_on(fleet, start_router):
    """A burst opens a connection per request; once idle for --backend-keepalive-timeout they close. The
    /load polls (here every 50 ms) and health probes keep one connection of their own: through the
    proxy's pool they once kept every connection of the burst open (aiohttp reuses the oldest idle one
    first, so frequent polls kept them all fresh)."""
    backend = fleet[0]
    router = start_router(
        [backend],
        "--backend-api-key",
        BACKEND_KEY,
        "--api-key",
        ROUTER_KEY,
        "--load-poll-interval",
        "0.05",
        "--backend-keepalive-timeout",
        "1",
        "--health-check-interval",
        "600",  # (the backend is stopped for a while below: no ejection)
    )
    with ThreadPoolExecutor(24) as burst:
        with Stopped(backend):  # every request of the burst waits on a connection of its own
            replies = [burst.submit(complete, router.base_url, f"Burst {i}") for i in range(24)]
            assert wait_until(lambda: backend_connections(router, backend) >= 24, 60, 0.1)
        assert all(f.result()[0] == 200 for f in replies)
    assert wait_until(lambda: backend_connections(router, backend) <= 2, 60, 0.2), backend_connections(router, backend)


def test_prefix_policy_keeps_a_prefix_on_one_backend(fleet, start_router):
    backends = fleet[:3]
    router = start_router(backends, "--policy", "prefix", "--backend-api-key", BACKEND_KEY, "--api-key", ROUTER_KEY)
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key=ROUTER_KEY, max_retries=0)
    shared = "Here is a long document that every question in this group is about. " * 20

    def landed(send) -> list[float]:
        before = Scrape(router)
        for i in range(4):
            send(i)
        after = Scrape(router)
        return [
            after.value(REQUESTS, backend=b.base_url) - before.value(REQUESTS, backend=b.base_url) for b in backends
        ]

    for group in range(4):
        shares = landed(lambda i, g=group: complete(router.base_url, f"Group {g}. {shared} Question {i}?"))
        assert sorted(shares) == [0, 0, 4], (group, shares)
        system = {"role": "system", "content": f"Group {group}. {shared}"}
        shares = landed(
            lambda i, s=system: client.chat.completions.create(
                model=MODEL, max_tokens=2, messages=[s, {"role": "user", "content": f"Question {i}?"}]
            )
        )
        assert sorted(shares) == [0, 0, 4], (group, shares)


def test_router_keys_and_limits(fleet, start_router):
    backends = fleet[:3]
    router = start_router(
        backends, "--api-key", ROUTER_KEY, "--backend-api-key", BACKEND_KEY, "--max-body-size", "1KiB"
    )
    status, body = complete(router.base_url, key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key", body
    assert complete(router.base_url, key="wrong-key-000")[0] == 401
    assert complete(router.base_url, key=BACKEND_KEY)[0] == 401  # the backends' key is not the router's
    assert complete(router.base_url)[0] == 200
    assert http("GET", router.base_url + "/health")[0] == 200  # probes stay public
    assert http("GET", router.base_url + "/metrics")[0] == 200
    before = Scrape(router).value(REQUESTS)
    status, body = complete(router.base_url, prompt="x" * 2048)
    assert status == 413 and body["error"]["code"] == "body_too_large", body
    assert Scrape(router).value(REQUESTS) == before  # refused before any backend saw it
    status, body = http("GET", router.base_url + "/admin", headers={"Authorization": f"Bearer {ROUTER_KEY}"})
    assert status == 404 and body["error"]["code"] == "not_found"
    keyless = start_router(backends)  # holds no key for the backends: their 401 comes back as it is
    status, body = complete(keyless.base_url, key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_no_backend_up(start_router):
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = start_router([nowhere])
    assert router.health()["status"] == "unhealthy"
    assert http("GET", router.base_url + "/health")[0] == 503
    status, body = complete(router.base_url, key=None, timeout=30)
    assert status == 503 and body["error"]["code"] == "no_backend", body
    assert Scrape(router).value("pagoda_router_failed_requests_total", code="no_backend") == 1


def test_an_unknown_expectation_is_a_417_in_openais_shape(start_router):
    router = start_router([f"http://127.0.0.1:{free_port()}"])
    for path in ("/v1/completions", "/health", "/nope"):
        method = "POST" if path.startswith("/v1") else "GET"
        status, body = http(method, router.base_url + path, b"{}", headers={"Expect": "200-ok"})
        assert status == 417 and body["error"]["code"] == "expectation_failed", body
        assert "200-ok" not in body["error"]["message"]  # nothing the client sent is echoed


def test_config_file_and_systemd_notifications(fleet, start_router, tmp_path):
    """`--config router.yaml` names the backends and the policy; under systemd (Type=notify) the router
    says READY=1 once it listens, STOPPING=1 on SIGTERM, then exits 0 (the fixture checks)."""
    config = tmp_path / "router.yaml"
    config.write_text(
        "backend:\n"
        + "".join(f"  - {b.base_url}\n" for b in fleet[:2])
        + f"policy: round_robin\nbackend-api-key: {BACKEND_KEY}\n"
    )
    notify = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(notify))
        sock.settimeout(30)
        router = start_router([], "--config", str(config), env={"NOTIFY_SOCKET": str(notify)})
        assert sock.recv(4096).decode().splitlines()[0] == "READY=1"
        assert [complete(router.base_url, key=None)[0] for _ in range(4)] == [200] * 4
        assert [sent_to(router, b) for b in fleet[:2]] == [2, 2]  # in turn
        router.process.send_signal(signal.SIGTERM)
        assert sock.recv(4096).decode().splitlines()[0] == "STOPPING=1"


def test_the_shipped_router_yaml_is_valid():
    from pagoda.api_proc.cli import build_parser
    from pagoda.api_proc.cli_config import parse_args_with_config
    from pagoda.api_proc.router.cli import router_settings

    example = Path(__file__).resolve().parents[2] / "deploy" / "router.yaml"
    settings = router_settings(parse_args_with_config(build_parser(), ["router", "--config", str(example)]))
    assert settings.backends == ("http://127.0.0.1:8001", "http://127.0.0.1:8002") and settings.policy == "p2c"
