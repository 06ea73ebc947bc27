"""Structured output: decode step time at batch 32 with and without a JSON schema (same run,
alternating), and how long the first request of a new schema waits for its grammar.

Decode: 32 requests on one chat prompt, temperature 1.0 with their own seeds, 64 new tokens each. The
free requests use ignore_eos; the constrained ones follow a schema whose smallest value is far longer
than 64 tokens, so both end by length in the same step. Only steps where all 32 requests decode
count. The runs alternate free / constrained `--repeats` times; medians are reported.

Compilation: the backend's compile of a schema it has not seen (a fresh property name each time), and
end to end on an idle engine: time to the first token of a request with a new schema minus that of
the same request once its grammar is cached. The backend's one-off load (xgrammar, tokenizer) is
reported apart: a server starts it right after its warm-up.

    python benchmarks/structured.py [--batch 32] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

from pagoda.engine_core import LLM, SamplingParams, StructuredOutputsParams
from pagoda.engine_core.tokenizer import encode_chat

ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["tool", "part", "kit"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["id", "name", "kind", "tags"],
}
SCHEMA = {
    "type": "object",
    "properties": {
        "warehouse": {"type": "string", "maxLength": 24},
        "items": {"type": "array", "items": ITEM, "minItems": 40},
    },
    "required": ["warehouse", "items"],
}
_ids = itertools.count()


def decode_step_ms(llm: LLM, prompt: list[int], params: list[SamplingParams]) -> float:
    """Mean time of the steps in which every one of the requests decodes one token."""
    engine = llm.engine
    for p in params:
        engine.add_request(f"bench-{next(_ids)}", prompt, p)
    times = []
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        full = (
            len(running) == len(params)
            and not engine.structured.num_pending
            and all(r.num_tokens - r.num_computed_tokens == 1 for r in running)
        )
        started = time.perf_counter()
        engine.step()
        if full:
            times.append(time.perf_counter() - started)
    return 1000 * statistics.mean(times)


def first_token_s(llm: LLM, prompt: list[int], params: SamplingParams) -> float:
    engine = llm.engine
    request_id = f"bench-{next(_ids)}"
    started = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    while not any(d.request_id == request_id and d.new_token_ids for d in engine.step()):
        pass
    elapsed = time.perf_counter() - started
    engine.abort_request(request_id)
    return elapsed


def fresh_schema(index: int) -> dict:
    return {**SCHEMA, "properties": {f"batch_{index}": {"type": "integer"}, **SCHEMA["properties"]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    llm = LLM(args.model, kv_cache_memory="1GiB")
    started = time.perf_counter()
    backend = llm.engine.structured.backend()
    load_s = time.perf_counter() - started
    prompt = encode_chat(llm.tokenizer, [{"role": "user", "content": "List the warehouse's items as JSON."}])
    constraint = StructuredOutputsParams(json=SCHEMA)

    def params(structured: bool) -> list[SamplingParams]:
        return [
            SamplingParams(
                temperature=1.0,
                seed=i,
                max_tokens=args.tokens,
                ignore_eos=not structured,
                structured_outputs=constraint if structured else None,
            )
            for i in range(args.batch)
        ]

    decode_step_ms(llm, prompt, params(False)[:4])  # warm both paths (and compile the schema once)
    decode_step_ms(llm, prompt, params(True)[:4])
    free, constrained = [], []
    for _ in range(args.repeats):
        free.append(decode_step_ms(llm, prompt, params(False)))
        constrained.append(decode_step_ms(llm, prompt, params(True)))
    free_ms, constrained_ms = statistics.median(free), statistics.median(constrained)

    compile_ms = []
    for index in range(5):
        t = time.perf_counter()
        backend.compile(StructuredOutputsParams(json=fresh_schema(1000 + index)))
        compile_ms.append(1000 * (time.perf_counter() - t))
    waits = []
    for index in range(3):
        one = SamplingParams(
            temperature=1.0, seed=0, max_tokens=4, structured_outputs=StructuredOutputsParams(json=fresh_schema(index))
        )
        new = first_token_s(llm, prompt, one)
        cached = first_token_s(llm, prompt, one)
        waits.append(1000 * (new - cached))

    print(
        f"\nStructured output, batch {args.batch}, {args.tokens} tokens, temperature 1.0 "
        f"(medians of {args.repeats} alternating runs)"
    )
    print(
        f"  decode step, free           {free_ms:8.1f} ms  ({args.batch * 1000 / free_ms:6.1f} tok/s)  "
        f"runs {', '.join(f'{x:.1f}' for x in free)}"
    )
    print(
        f"  decode step, JSON schema    {constrained_ms:8.1f} ms  ({args.batch * 1000 / constrained_ms:6.1f} tok/s)  "
        f"runs {', '.join(f'{x:.1f}' for x in constrained)}"
    )
    print(f"  overhead per step           {100 * (constrained_ms / free_ms - 1):8.1f} %")
    print(
        f"  compile, new schema         {statistics.median(compile_ms):8.1f} ms (median of 5; schema "
        f"{len(json.dumps(SCHEMA))} chars)"
    )
    print(f"  first token: new schema - cached schema  {statistics.median(waits):8.1f} ms (median of 3)")
    print(f"  backend load (once per engine)           {1000 * load_s:8.1f} ms")


if __name__ == "__main__":
    main()
