"""The engine core in its own process, driven over real ZeroMQ sockets as the tokenizer process will."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import msgspec
import pytest

from pagoda.engine_core import protocol
from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.sampling_params import SamplingParams
from tests.engine_process import EngineProcess


@pytest.fixture(scope="module")
def core(tmp_path_factory, default_model_dir):
    client = EngineProcess(
        tmp_path_factory.mktemp("core"), EngineConfig(model=str(default_model_dir), kv_cache_memory=256 * 1024**2)
    )
    ready = client.recv()
    assert isinstance(ready, protocol.EngineReady) and ready.block_size == 16
    assert ready.max_model_len == (ready.num_blocks - 1) * 16  # a 256 MiB pool holds less than 8192 tokens
    yield client
    client.close()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_requests_over_sockets_match_the_offline_engine(core, default_model_dir, tokenizer):
    from pagoda.engine_core.llm import LLM

    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "Water boils at", "1, 2, 3,")]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    for i, prompt in enumerate(prompts):
        core.send(protocol.AddRequest(f"r{i}", protocol.pack_tokens(prompt), greedy))
    core.send(protocol.AddRequest("too-long", protocol.pack_tokens([5] * 6000), greedy))
    tokens, reasons = core.collect({"r0", "r1", "r2", "too-long"})
    assert reasons["too-long"].startswith("rejected:") and "context" in reasons["too-long"]
    offline = LLM(str(default_model_dir)).generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [tokens[f"r{i}"] for i in range(3)] == [o.outputs[0].token_ids for o in offline]


def test_abort_reports_and_frees(core):
    core.send(
        protocol.AddRequest("long", protocol.pack_tokens([5] * 30), SamplingParams(max_tokens=2000, ignore_eos=True))
    )
    first = core.recv()
    assert isinstance(first, protocol.StepOutputs) and first.deltas[0].request_id == "long"
    core.send(protocol.AbortRequests(["long", "never-existed"]))
    _, reasons = core.collect({"long"})
    assert reasons == {"long": "abort"}


def test_idle_engine_sends_heartbeats(core):
    deadline = time.monotonic() + 5
    beats = 0
    while time.monotonic() < deadline and beats < 2:
        if core.pull.poll(2500):
            message = protocol.output_decoder.decode(core.pull.recv())
            beats += isinstance(message, protocol.StepOutputs) and not message.deltas
    assert beats == 2


def _wait_for_heartbeat(core: EngineProcess) -> None:
    """Until the core sends an idle heartbeat: from then on it has nothing to do."""
    while core.pull.poll(5000):
        message = protocol.output_decoder.decode(core.pull.recv())
        if isinstance(message, protocol.StepOutputs) and not message.deltas:
            return
    raise TimeoutError("no heartbeat from the engine core")


def _cpu_in(pid: int, seconds: float) -> float:
    before = _cpu_seconds(pid)
    time.sleep(seconds)  # the window measured, not a wait for anything
    return _cpu_seconds(pid) - before


def test_idle_engine_uses_no_cpu(core):
    _wait_for_heartbeat(core)
    # The grammar backend loads on a thread after the warm-up (a few CPU seconds): wait it out.
    deadline = time.monotonic() + 60
    while _cpu_in(core.process.pid, 1.0) > 0.05:
        assert time.monotonic() < deadline, "the idle engine never stopped using CPU"
    assert _cpu_in(core.process.pid, 2.0) < 0.1


@pytest.fixture
def own_core(tmp_path, default_model_dir):
    """A core of its own, for a test that ends it (the module's shared one must outlive every test)."""
    client = EngineProcess(tmp_path, EngineConfig(model=str(default_model_dir), kv_cache_memory=64 * 1024**2))
    assert isinstance(client.recv(), protocol.EngineReady)
    yield client
    client.close()


def test_bad_frame_kills_nothing_silently(own_core):
    """A frame that is not a protocol message makes the core report EngineDead and exit non-zero."""
    own_core.push.send(msgspec.msgpack.encode({"not": "a message"}))
    message = own_core.recv(timeout_s=10)
    assert isinstance(message, protocol.EngineDead)
    own_core.process.join(10)
    assert own_core.process.exitcode == 1


def test_shutdown_message_exits_cleanly(own_core):
    own_core.send(protocol.Shutdown())
    own_core.process.join(10)
    assert own_core.process.exitcode == 0


def test_loading_takes_the_start_up_heap_out_of_the_collectors_reach(tmp_path, default_model_dir):
    """Once loaded, what start-up allocated is frozen (gc.freeze): full collections walked all of it (the
    model, the tokenizer, torch's modules) and stalled the engine loop for 110-190 ms each."""
    from pagoda.engine_core.core_proc import EngineCoreProc

    proc = EngineCoreProc(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    gc.unfreeze()  # (this test process's own count starts at zero)
    try:
        proc.load(EngineConfig(model=str(default_model_dir), kv_cache_memory=64 * 1024**2))
        assert gc.get_freeze_count() > 100_000
    finally:
        gc.unfreeze()
        proc.close()
