"""Real `pagoda serve` processes for the API tests.

Every fixture here is module-scoped: each test module gets servers of its own, started fresh (tests rely
on that: metrics move by exactly what the module's requests did, the prefix cache holds only their
prompts), and stopped when the module is done, each asserted to exit 0.
"""

from __future__ import annotations

import openai
import pytest

from pagoda.api_proc.bench.local_server import PagodaServer


@pytest.fixture(scope="module")
def start_server(tmp_path_factory, request):
    """A function starting a `pagoda serve` with extra flags (in a fresh directory named after the module);
    the servers it started stop when the module is done."""
    servers: list[PagodaServer] = []
    prefix = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")

    def start(*extra_args: str) -> PagodaServer:
        server = PagodaServer(tmp_path_factory.mktemp(prefix), *extra_args)
        servers.append(server)
        return server

    yield start
    exit_codes = [server.stop() for server in servers]
    assert exit_codes == [0] * len(servers), [server.log()[-2000:] for server in servers]


@pytest.fixture(scope="module")
def server(start_server) -> PagodaServer:
    """The module's server with the default flags."""
    return start_server()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    """The OpenAI SDK for the module's server (no retries: a failure shows as it happened)."""
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
