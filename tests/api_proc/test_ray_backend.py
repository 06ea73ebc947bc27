"""`pagoda serve --distributed-executor-backend ray`: engine replicas as Ray actors, on a real Ray cluster of
two simulated nodes (`ray.cluster_utils.Cluster`, one CPU each) and on the local cluster the server
starts by itself.

Two replicas land on the two nodes and answer exactly as a single `mp` engine does; a replica whose actor
is SIGKILLed fails its requests at once and comes back in a fresh placement group; a placement the cluster
cannot satisfy fails start-up within --ray-placement-timeout, naming what was asked and what exists; after
SIGTERM and after kill -9 of the server no actor is alive and no placement group is left; with a local
cluster, kill -9 leaves no process at all (Ray's included).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import ray

from pagoda.api_proc.bench.local_server import MODEL_NAME, PagodaServer, http, wait_until
from tests.process_checks import kill_9_leaves_nothing

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of one CPU each, and this process connected to them as a driver (to look at actors
    and placement groups)."""
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    ray.init(address=nodes.address, logging_level="WARNING")
    yield nodes
    ray.shutdown()
    nodes.shutdown()


def alive_actors() -> list[dict]:
    import ray._private.state as state

    return [actor for actor in state.actors().values() if actor["State"] == "ALIVE"]


def live_placement_groups() -> list[dict]:
    return [group for group in ray.util.placement_group_table().values() if group["state"] != "REMOVED"]


def ray_server(tmp_path, cluster, *args: str) -> PagodaServer:
    return PagodaServer(
        tmp_path,
        "--distributed-executor-backend",
        "ray",
        "--ray-address",
        cluster.address,
        *args,
        ready_timeout=300,
    )


def complete_all(server: PagodaServer, prompts: list[str], **params) -> list[str]:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)

    def one(prompt: str) -> str:
        return client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0, **params).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, prompts))


PROMPTS = [f"Question {i}: what is {i} plus {i * 3}? Answer:" for i in range(64)]


def test_two_replicas_on_two_nodes_answer_as_one_engine(tmp_path, cluster, start_server):
    server = ray_server(tmp_path, cluster, "--data-parallel-size", "2")
    try:
        actors = alive_actors()
        assert len(actors) == 2 and len({a["Address"]["NodeID"] for a in actors}) == 2  # one per node
        assert len(live_placement_groups()) == 2
        through_ray = complete_all(server, PROMPTS, max_tokens=8)
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    assert complete_all(start_server(), PROMPTS, max_tokens=8) == through_ray
    # SIGTERM: drained, then the actors killed and the placement groups removed.
    assert wait_until(lambda: alive_actors() == [] and live_placement_groups() == [], 10.0, 0.2)


def test_a_killed_actor_fails_its_requests_and_its_replica_comes_back(tmp_path, cluster):
    server = ray_server(tmp_path, cluster, "--data-parallel-size", "2")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    try:
        results: list[str] = []

        def stream(prompt: str) -> None:
            try:
                chunks = client.completions.create(
                    model=MODEL_NAME,
                    prompt=prompt,
                    max_tokens=400,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                results.append("ok" if sum(1 for _ in chunks) else "empty")
            except openai.APIError as exc:
                results.append(f"error: {exc}")

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(stream, f"Story {i}:") for i in range(6)]
            assert wait_until(lambda: _running(server) >= 4, 60.0, 0.1)
            victim = alive_actors()[0]
            os.kill(victim["Pid"], signal.SIGKILL)
            for future in futures:
                future.result(timeout=300)
        assert any(r.startswith("error") for r in results), results  # the killed replica's requests
        assert "ok" in results  # the other replica's went on
        assert wait_until(lambda: http("GET", server.base_url + "/health")[1]["status"] == "ok", 120.0, 0.5)
        assert len(alive_actors()) == 2 and len(live_placement_groups()) == 2  # recreated, the old group gone
        assert complete_all(server, PROMPTS[:8], max_tokens=4)
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def _running(server: PagodaServer) -> float:
    _, text = http("GET", server.base_url + "/metrics")
    assert isinstance(text, str)
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running{")
    )


def test_a_pipeline_over_two_nodes_answers_as_one_engine_and_a_dead_rank_ends_it_cleanly(
    tmp_path, cluster, start_server
):
    """Two stages on two one-CPU nodes: rank 1 is a Ray actor on the other node, which gets its steps over
    tcp with CURVE and meets rank 0 at its TCPStore; the answers equal a single engine's. SIGKILL of that
    rank is noticed while idle and, this being the only replica, ends the server with exit 1 naming the
    rank, leaving no actor and no placement group."""
    server = ray_server(tmp_path, cluster, "--pipeline-parallel-size", "2")
    try:
        actors = alive_actors()
        assert sorted(a["ActorClassName"] for a in actors) == ["EngineActor", "RankActor"]
        assert len({a["Address"]["NodeID"] for a in actors}) == 2  # one stage per node
        assert len(live_placement_groups()) == 1
        assert "2 ranks (tensor parallel 1 x pipeline parallel 2; gloo, on 2 machines)" in server.log()
        through_ray = complete_all(server, PROMPTS[:16], max_tokens=8)
        rank = next(a for a in actors if a["ActorClassName"] == "RankActor")
        os.kill(rank["Pid"], signal.SIGKILL)
        assert server.process.wait(timeout=60) == 1
        assert "WorkerDied: rank 1 (pipeline stage 2, tensor-parallel rank 0) (Ray actor on node" in server.log()
    finally:
        server.stop()
    assert wait_until(lambda: alive_actors() == [] and live_placement_groups() == [], 10.0, 0.2)
    assert complete_all(start_server(), PROMPTS[:16], max_tokens=8) == through_ray


def test_a_placement_the_cluster_cannot_satisfy_fails_start_up_naming_the_resources(tmp_path, cluster):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagoda.api_proc.cli",
            "serve",
            "--distributed-executor-backend",
            "ray",
            "--ray-address",
            cluster.address,
            "--ray-cpus-per-rank",
            "8",
            "--ray-placement-timeout",
            "5",
            "--port",
            "0",
        ],
        env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1  # (within the subprocess timeout: it gave up, as the message says)
    assert "Ray could not place {'CPU': 8.0} on one node within 5s" in run.stderr, run.stderr[-3000:]
    assert "the cluster has {'CPU': 2.0} in all" in run.stderr
    assert wait_until(lambda: alive_actors() == [] and live_placement_groups() == [], 10.0, 0.2)


def test_kill_9_of_the_server_leaves_no_actor_and_no_placement_group(tmp_path, cluster):
    server = ray_server(tmp_path, cluster, "--data-parallel-size", "2")
    assert len(alive_actors()) == 2
    server.process.kill()
    server.process.wait()
    assert wait_until(lambda: alive_actors() == [] and live_placement_groups() == [], 10.0, 0.2)
    server.stop()


def test_a_local_cluster_goes_with_the_server_even_after_kill_9(tmp_path):
    """No --ray-address, tensor parallel 2: both ranks are actors on this node (sharing memory), and the
    server's own cluster (pagoda-ray and Ray's processes below it) and its actors all go within 2 s of
    kill -9."""
    server = PagodaServer(
        tmp_path, "--distributed-executor-backend", "ray", "--tensor-parallel-size", "2", ready_timeout=300
    )
    reply = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0).completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=2, temperature=0
    )
    assert reply.usage.completion_tokens == 2
    kill_9_leaves_nothing(server)
    server.stop()
