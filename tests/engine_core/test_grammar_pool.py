"""Grammar compiles on the real engine (offline `LLM`): oversized specs are refused before any compile,
a compile past the time limit is stopped and refused, small specs compile while a big one runs, and a
compile nobody waits for any more is cancelled (its worker process killed)."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagoda.engine_core import LLM, SamplingParams, StructuredOutputsParams
from pagoda.engine_core.validation import ParamError

# A schema of a few KB per hundred properties whose compile takes minutes (2,000 took 38 s here):
# only a time limit or a cancel ends it quickly.
SLOW_PROPERTIES = 3000


def slow_schema(tag: str) -> dict:
    return {"type": "object", "properties": {f"{tag}_{i}": {"type": "string"} for i in range(SLOW_PROPERTIES)}}


def spec_params(max_tokens: int = 4, **spec) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**spec))


def wait_until(condition, what: str, limit: float = 120.0) -> None:
    """Poll `condition` (state the pool's threads change) until it holds; the limit only ends a hung test."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def run_until_finished(engine, request_id: str, limit: float = 120.0) -> list:
    deltas, deadline = [], time.monotonic() + limit
    while not any(d.request_id == request_id and d.finish_reason for d in deltas):
        assert time.monotonic() < deadline, f"{request_id} never finished"
        deltas += engine.step()
        assert not [r for r in engine.take_ended() if r.request_id == request_id]  # (compiled, not refused)
    return [d for d in deltas if d.request_id == request_id]


@pytest.fixture(scope="module")
def pool_llm(default_model_dir):
    """Two compile workers and no time limit (slow compiles run until cancelled); limits that let the
    slow schemas in."""
    llm = LLM(
        str(default_model_dir),
        kv_cache_memory="64MiB",
        structured_output_compile_timeout=None,
        structured_output_max_properties=4000,
        structured_output_max_bytes=256 * 1024,
        structured_output_max_choices=100,
        structured_output_compile_workers=2,
    )
    yield llm
    llm.close()


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            {"json": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(4001)}}},
            "the JSON schema has 4001 properties; this server allows at most 4000 (--structured-output-max-properties)",
        ),
        (
            {"json": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}}}},
            None,  # nested properties are counted, and two are within the limit
        ),
        ({"regex": "a" * (256 * 1024 + 1)}, "is 262145 bytes long; this server allows at most 262144 bytes"),
        ({"choice": [str(i) for i in range(101)]}, "lists 101 choices; this server allows at most 100"),
        ({"grammar": 'root ::= "' + "x" * (256 * 1024) + '"'}, "(--structured-output-max-bytes)"),
    ],
)
def test_oversized_specs_are_refused_before_any_compile(pool_llm, spec, message):
    engine, structured = pool_llm.engine, pool_llm.engine.structured
    before = structured.num_compiles
    if message is None:
        pool_llm.generate("x", spec_params(**spec), use_tqdm=False)
        return
    with pytest.raises(ParamError, match=re.escape(message)) as info:
        engine.add_request("over", [1, 2, 3], spec_params(**spec))
    assert info.value.param == "structured_outputs"
    assert not engine.has_unfinished_requests() and structured.num_compiles == before
    assert structured.pool.num_compiling == 0


def test_a_compile_past_the_time_limit_is_stopped_and_refused(default_model_dir):
    llm = LLM(
        str(default_model_dir),
        kv_cache_memory="64MiB",
        structured_output_compile_timeout=1.0,
        structured_output_max_properties=None,
        structured_output_compile_workers=1,
    )
    pool = llm.engine.structured.pool
    try:
        with pytest.raises(ValueError, match=re.escape("longer than 1 s to compile")) as info:
            llm.generate("x", spec_params(json=slow_schema("t"), source="guided_json"), use_tqdm=False)
        assert "Invalid 'guided_json'" in str(info.value) and "(--structured-output-compile-timeout)" in str(info.value)
        assert pool.num_timed_out == 1 and pool.num_killed == 1  # its worker was killed, not left to run
        # The one worker's successor serves the next spec.
        out = llm.generate("Number:", spec_params(8, regex="[0-9]+"), use_tqdm=False)[0].outputs[0]
        assert re.fullmatch("[0-9]+", out.text)
    finally:
        llm.close()


def test_a_small_spec_compiles_while_a_big_one_does(pool_llm):
    engine, pool = pool_llm.engine, pool_llm.engine.structured.pool
    engine.add_request("big", [1, 2, 3], spec_params(json=slow_schema("big")))
    wait_until(lambda: pool.num_compiling == 1, "the big schema's compile started")
    engine.add_request("small", [1, 2, 3], spec_params(8, regex="[0-9]+"))
    run_until_finished(engine, "small")
    assert engine.structured.has_pending("big")  # still compiling: the small one did not wait for it
    engine.abort_request("big")
    wait_until(lambda: pool.num_compiling == 0, "the big compile was stopped")


def test_compiles_nobody_waits_for_are_cancelled(pool_llm):
    engine, structured = pool_llm.engine, pool_llm.engine.structured
    pool = structured.pool
    cancelled, killed = pool.num_cancelled, pool.num_killed
    # Two requests on one spec, and two more specs: both workers busy, the third spec queued.
    for request_id, tag, compiling in [("a1", "a", 1), ("a2", "a", 1), ("b", "b", 2)]:
        engine.add_request(request_id, [1, 2, 3], spec_params(json=slow_schema(tag)))
        wait_until(lambda n=compiling: pool.num_compiling == n, f"{request_id}'s compile started")
    engine.add_request("c", [1, 2, 3], spec_params(json=slow_schema("c")))

    assert engine.abort_request("c")  # queued: dropped, no worker touched
    assert (pool.num_cancelled, pool.num_killed, pool.num_compiling) == (cancelled + 1, killed, 2)
    assert engine.abort_request("a1")  # a2 still waits for the same compile: it goes on
    assert pool.num_cancelled == cancelled + 1
    assert engine.abort_request("a2") and engine.abort_request("b")  # nobody waits: both workers killed
    assert pool.num_cancelled == cancelled + 3
    wait_until(lambda: pool.num_killed == killed + 2 and pool.num_compiling == 0, "both compiles were killed")
    assert not engine.has_unfinished_requests()
    # The workers' successors compile what comes next.
    out = pool_llm.generate("Number:", spec_params(8, regex="[0-9]{2}"), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[0-9]{2}", out.text)


def _children_named(parent: int, name: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                lines = (entry / "status").read_text().splitlines()
                status = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
                if status.get("PPid", "").strip() == str(parent) and status.get("Name", "").strip() == name:
                    found.append(int(entry.name))
    return found


_ENGINE_IGNORING_SIGTERM = """
import json, signal, sys, threading, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as an engine under `pagoda serve` does
from pagoda.engine_core import LLM, SamplingParams, StructuredOutputsParams
llm = LLM(sys.argv[1], kv_cache_memory="64MiB", structured_output_compile_workers=1,
          structured_output_compile_timeout=None, structured_output_max_properties=4000,
          structured_output_max_bytes=256 * 1024)
slow = StructuredOutputsParams(json=json.loads(sys.argv[2]))  # a compile of minutes
threading.Thread(target=llm.generate, args=(["{"], SamplingParams(max_tokens=2, structured_outputs=slow)),
                 kwargs={"use_tqdm": False}, daemon=True).start()
time.sleep(2)
print("compiling", flush=True)
sys.stdin.read()
"""


def test_workers_of_an_engine_that_ignores_sigterm_die_with_it(default_model_dir):
    """Under `pagoda serve` the engine ignores SIGTERM (its parent decides when it stops), and an ignored
    signal is inherited across exec: a compile worker's parent-death signal must still end it at once when
    the engine is killed, even in the middle of a compile (it was SIGTERM, ignored, and a worker lived on
    until its compile ended and it read its pipe)."""
    engine = subprocess.Popen(
        [sys.executable, "-c", _ENGINE_IGNORING_SIGTERM, str(default_model_dir), json.dumps(slow_schema("s"))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert engine.stdout is not None and engine.stdout.readline().strip() == "compiling"
        workers = _children_named(engine.pid, "pagoda-grammar")
        assert workers
    finally:
        engine.kill()
        engine.wait()
    deadline = time.monotonic() + 2.0
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]
