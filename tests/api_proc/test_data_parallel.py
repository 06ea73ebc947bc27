"""`pagoda serve --data-parallel-size 2` against a single-engine server, both real: routing spreads the
load and keeps prefixes together, every request's tokens are the single engine's, aborts reach the
replica that runs the request, a killed replica fails only its own requests and comes back, and
kill -9 of the parent leaves nothing behind."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from pagoda.api_proc.bench.local_server import MODEL_NAME, PagodaServer, alive, http, process_names, wait_until
from pagoda.api_proc.client import EngineClient
from pagoda.engine_core.sampling_params import SamplingParams
from tests.metrics_scrape import Scrape, delta, scrape_until
from tests.process_checks import descendants, kill_9_leaves_nothing

ENGINES = ("0", "1")


@pytest.fixture(scope="module")
def servers(start_server) -> tuple[PagodaServer, PagodaServer]:
    """(one engine, two replicas), started side by side."""
    with ThreadPoolExecutor(2) as pool:
        single = pool.submit(start_server)
        dp = pool.submit(start_server, "--data-parallel-size", "2")
        return single.result(), dp.result()


def openai_client(server: PagodaServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def complete_all(server: PagodaServer, prompts: list, concurrency: int, **params) -> list[str]:
    client = openai_client(server)

    def one(prompt) -> str:
        reply = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0, **params)
        return reply.choices[0].text

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def per_engine(before: Scrape, after: Scrape, name: str, **labels: str) -> list[float]:
    return [delta(before, after, name, engine=engine, **labels) for engine in ENGINES]


def test_requests_spread_over_the_replicas_with_the_single_engines_tokens(servers):
    single, dp = servers
    prompts = [f"Request {i}: write one sentence about the number {i}." for i in range(64)]
    before = Scrape(dp)
    expected = complete_all(single, prompts, 64, max_tokens=8)
    assert complete_all(dp, prompts, 64, max_tokens=8) == expected
    after = Scrape(dp)
    shares = per_engine(before, after, "vllm:request_success_total")
    assert sum(shares) == 64 and min(shares) >= 16, shares  # each replica took a fair share
    assert after.value("vllm:num_requests_running") == 0 and after.value("vllm:kv_cache_usage_perc") == 0


def test_direct_clients_are_routed_too(servers):
    dp = servers[1]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    texts = []
    for server in servers:
        client = EngineClient(server.frontend)
        texts.append("".join(d.text for d in client.generate("The capital of Italy is", params, timeout=60)))
        client.close()
    assert texts[0] == texts[1] and texts[0]
    client = EngineClient(dp.frontend)
    report = client.health()
    client.close()
    assert report.healthy and not report.degraded and [e.state for e in report.engines] == ["ok", "ok"]


def test_an_abort_reaches_the_replica_that_runs_all_samples_of_the_request(servers):
    _, dp = servers
    before = Scrape(dp)
    stream = openai_client(dp).completions.create(
        model=MODEL_NAME, prompt="Tell me a long story.", max_tokens=2000, n=2, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))  # generating now
    running = scrape_until(dp, lambda s: s.value("vllm:num_requests_running") == 2)
    counts = [running.value("vllm:num_requests_running", engine=e) for e in ENGINES]
    assert sorted(counts) == [0, 2], counts  # both samples on one replica
    busy = ENGINES[counts.index(2)]
    assert running.value("vllm:kv_cache_usage_perc", engine=busy) > 0
    stream.close()  # the client goes away: the replica running it must stop and free its blocks

    after = scrape_until(
        dp,
        lambda s: s.value("vllm:num_requests_running") == 0 and s.value("vllm:kv_cache_usage_perc", engine=busy) == 0,
    )
    assert after.value("vllm:num_requests_running") == 0
    assert after.value("vllm:kv_cache_usage_perc", engine=busy) == 0
    aborted = per_engine(before, after, "vllm:request_success_total", finished_reason="abort")
    assert aborted[int(busy)] == 2 and sum(aborted) == 2


def test_a_stop_string_stops_the_replica_that_runs_the_request(servers):
    _, dp = servers
    reply = openai_client(dp).completions.create(
        model=MODEL_NAME, prompt="Write a long essay about rivers.", max_tokens=4000, temperature=0, stop=[" "],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens < 20
    # The engine found no stop itself: the tokenizer process must have told the right replica to stop.
    idle = scrape_until(
        dp, lambda s: s.value("vllm:num_requests_running") == 0 and s.value("vllm:kv_cache_usage_perc") == 0, 10.0
    )
    assert idle.value("vllm:num_requests_running") == 0 and idle.value("vllm:kv_cache_usage_perc") == 0


def test_requests_sharing_a_prefix_land_on_one_replica(servers):
    rng = random.Random(0)
    prefix = [rng.randrange(1000, 20000) for _ in range(1024)]
    prompts = [prefix + [rng.randrange(1000, 20000) for _ in range(16)] for _ in range(16)]
    rates = []
    for server in servers:
        before = Scrape(server)
        complete_all(server, prompts, 8, max_tokens=2)
        after = Scrape(server)
        queries = delta(before, after, "vllm:prefix_cache_queries_total")
        rates.append(delta(before, after, "vllm:prefix_cache_hits_total") / queries)
        if server is servers[1]:
            assert sorted(per_engine(before, after, "vllm:request_success_total")) == [0, 16]
    single_rate, dp_rate = rates
    assert single_rate > 0.8 and dp_rate >= 0.8 * single_rate, rates


@pytest.mark.slow
def test_a_killed_replica_fails_only_its_requests_and_comes_back(servers):
    _, dp = servers
    client = openai_client(dp)
    outcomes: list = [None] * 8

    def one(i: int) -> None:
        try:
            reply = client.completions.create(
                model=MODEL_NAME, prompt=f"Story {i}:", max_tokens=200, temperature=0, extra_body={"ignore_eos": True}
            )
            outcomes[i] = reply.usage.completion_tokens
        except openai.APIStatusError as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    scrape_until(dp, lambda s: all(s.value("vllm:num_requests_running", engine=e) > 0 for e in ENGINES))
    victim = dp.child_named("pagoda-engine0")
    os.kill(victim, signal.SIGKILL)
    assert wait_until(lambda: http("GET", dp.base_url + "/health")[1]["status"] == "degraded", 10.0, 0.1)
    status, body = http("GET", dp.base_url + "/health")
    assert status == 200 and [e["state"] for e in body["engines"]] == ["restarting", "ok"], body
    for thread in threads:
        thread.join(120)

    failed = [o for o in outcomes if isinstance(o, Exception)]
    assert failed and len(failed) < 8, outcomes  # replica 0's requests failed, replica 1's finished
    assert all(o == 200 for o in outcomes if not isinstance(o, Exception)), outcomes
    for exc in failed:  # a 500 in OpenAI's shape
        assert exc.status_code == 500, exc
        assert exc.body["type"] == "server_error" and exc.body["code"] == "engine_dead", exc.body

    assert wait_until(lambda: http("GET", dp.base_url + "/health")[1]["status"] == "ok", 180.0, 0.5)
    assert dp.child_named("pagoda-engine0") != victim
    before = Scrape(dp)
    prompts = [f"After the restart, request {i}." for i in range(8)]
    assert all(complete_all(dp, prompts, 8, max_tokens=4))
    shares = per_engine(before, Scrape(dp), "vllm:request_success_total")
    assert sum(shares) == 8 and min(shares) >= 1, shares  # the restarted replica serves again


@pytest.mark.slow
def test_a_stalled_replica_is_restarted_and_kill_9_of_the_parent_leaves_nothing(tmp_path):
    """A replica whose loop stops (SIGSTOP) is killed and restarted; kill -9 of the parent then, with a
    replica still loading, takes every process with it within 2 s."""
    server = PagodaServer(tmp_path, "--data-parallel-size", "2", "--engine-stall-timeout", "5")
    stalled = server.child_named("pagoda-engine1")
    os.kill(stalled, signal.SIGSTOP)
    assert wait_until(lambda: not alive(stalled), 30.0, 0.2)  # seen stalled by the tokenizer, killed
    status, body = http("GET", server.base_url + "/health")
    assert status == 200 and body["status"] == "degraded" and "stalled" in body["message"], body
    assert wait_until(lambda: "pagoda-engine1" in process_names(server).values(), 10.0, 0.1)  # restarting

    assert {"pagoda-engine0", "pagoda-engine1", "pagoda-detok", "pagoda-api"} <= set(process_names(server).values())
    kill_9_leaves_nothing(server)
    server.stop()


@pytest.mark.slow
def test_kill_9_of_the_parent_under_tensor_parallel_2_x_data_parallel_2(tmp_path, monkeypatch):
    """Two replicas of two tensor-parallel ranks each (the workers are the engines' children), serving:
    kill -9 of the parent takes all of them along, with their shared-memory rings and groups' files."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the groups' directories go here, to be checked
    server = PagodaServer(
        tmp_path, "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--cpu-threads-bind", "none"
    )
    reply = openai_client(server).completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4
    workers = [
        p for p in descendants(server.process.pid) if Path(f"/proc/{p}/comm").read_text().startswith("pagoda-tp")
    ]
    assert len(workers) == 2
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("pagoda-tp-")]) == 2
    kill_9_leaves_nothing(server, group_dirs=tmp_path)
    server.stop()


def test_replicas_that_cannot_be_pinned_are_refused_at_start(tmp_path):
    run = subprocess.run(  # two replicas on the same CPU
        [
            sys.executable,
            "-m",
            "pagoda.api_proc.cli",
            "serve",
            "--data-parallel-size",
            "2",
            "--cpu-threads-bind",
            "0|0",
        ],
        env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "share CPU" in run.stderr, run.stderr
    assert list(tmp_path.iterdir()) == []  # no runtime directory left
