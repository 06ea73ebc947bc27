"""A grammar compile worker: a child process of the engine that compiles one spec at a time with
xgrammar and sends back the compiled grammar, serialized (engine_core/grammar_pool.py drives it).

Why a process: xgrammar's compile is one C++ call that cannot be interrupted (no cancel or timeout
in 0.2.9; mlc-ai/xgrammar#298). In a thread, a compile nobody waits for any more (its client left,
or it ran past the time limit) would go on burning a core and growing the engine's memory for as
long as it takes (minutes, gigabytes). A process is killed, and everything it held goes with it.

Protocol, over the pipe pair only (stdout is pointed at stderr, so stray prints cannot corrupt it):
frames of a 4-byte big-endian length and a msgpack body.
- engine -> worker, first: {"tokenizer_info": <TokenizerInfo JSON>, "max_threads": n, "niceness": n}
- worker -> engine: [true, ""] once it can compile
- engine -> worker: [kind, spec] (StructuredOutputsParams.cache_key()), one at a time
- worker -> engine: [true, <CompiledGrammar JSON>] or [false, <what is wrong, fit for a 400>]
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import struct
import sys
import threading

import msgspec

from pagoda.engine_core.json_schema_support import unsupported_feature

HEADER = struct.Struct(">I")
_XGRAMMAR_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")  # "[12:00:00] /project/cpp/x.cc:94: "
KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


class SpecError(ValueError):
    """What is wrong with a spec, without naming the request field (the engine adds that)."""


def choice_grammar(choices: list[str]) -> str:
    """EBNF for "exactly one of these strings". JSON string escapes are the EBNF's; non-ASCII text
    stays literal (xgrammar reads \\u escapes of surrogate pairs as two characters)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def compile_spec(compiler, kind: str, spec: str):
    """The compiled grammar for the spec `(kind, spec)` (a cache key), or SpecError."""
    if kind == "json":
        problem = unsupported_feature(json.loads(spec))
        if problem:
            raise SpecError(f"the JSON schema uses {problem}, which structured output cannot enforce.")
    try:
        if kind == "json":
            return compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(json.loads(spec)))
        return compiler.compile_grammar(spec)
    except Exception as exc:  # noqa: BLE001 - xgrammar reports every bad spec as some exception
        message = _XGRAMMAR_LOCATION.sub("", str(exc)).strip()
        raise SpecError(f"the {KIND_NAMES[kind]} cannot be compiled: {message}") from None


def write_frame(fd: int, message: object) -> None:
    body = msgspec.msgpack.encode(message)
    view = memoryview(HEADER.pack(len(body)) + body)
    while view:
        view = view[os.write(fd, view) :]


def read_frame(fd: int) -> object | None:
    """The next message, or None at end of file (the engine closed the pipe or is gone)."""
    header = _read_exact(fd, HEADER.size)
    if header is None:
        return None
    body = _read_exact(fd, HEADER.unpack(header)[0])
    return None if body is None else msgspec.msgpack.decode(body)


def _read_exact(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _load(init: dict, loaded: dict) -> None:
    """Import xgrammar and rebuild the engine's TokenizerInfo, at `niceness` (a worker started ahead
    of need imports at the lowest priority, like the engine's own backend load). Niceness is per
    thread on Linux, so the compiles, on the main thread, keep the normal priority."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), init["niceness"])
    import xgrammar as xgr

    loaded["info"] = xgr.TokenizerInfo.deserialize_json(init["tokenizer_info"])
    loaded["xgr"] = xgr


def main() -> int:
    from pagoda.engine_core.lifecycle import die_with_parent, name_process

    name_process("pagoda-grammar")
    # SIGKILL: it holds nothing to clean up, and it inherits the engine's ignored SIGTERM under `pagoda
    # serve` (so a SIGTERM to the process group leaves its compiles running while the server drains).
    die_with_parent(signal.SIGKILL, parent=int(sys.argv[1]) if len(sys.argv) > 1 else None)
    requests, replies = sys.stdin.fileno(), os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    init = read_frame(requests)
    if not isinstance(init, dict):
        return 0
    loaded: dict = {}
    loader = threading.Thread(target=_load, args=(init, loaded), name="pagoda-grammar-load")
    loader.start()
    loader.join()
    # Built here, not in the loader: the compiler's threads inherit the priority of the thread that
    # creates them.
    compiler = loaded["xgr"].GrammarCompiler(loaded["info"], max_threads=init["max_threads"], cache_enabled=False)
    write_frame(replies, [True, ""])
    while isinstance(job := read_frame(requests), list):  # (None: the engine closed the pipe)
        kind, spec = job
        try:
            reply = [True, compile_spec(compiler, kind, spec).serialize_json()]
        except SpecError as exc:
            reply = [False, str(exc)]
        write_frame(replies, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
