"""Speculative decoding (n-gram proposals) on and off, side by side, on the default model (SmolLM2, fp32),
in-process `EngineCore`s, the two cases alternating over --repeats rounds.

  copy     one stream at a time over the 20 bundled prompts whose answers copy spans of the prompt
           (repeat a text, rename a function, add a docstring: benchmarks/data/spec_prompts.json), 128
           greedy tokens each: decode tok/s, acceptance rate and mean acceptance length.
  chat     the same over 8 free-form chat prompts, where proposals rarely hold.
  batch    64 requests at once, 128 -> 128 (random token prompts): output tok/s, where speculation must
           stand down (--speculative-disable-batch-size) rather than slow the server.

    python -m benchmarks.spec_decode --repeats 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from engine_core.config import EngineConfig
from engine_core.default_model import ensure_default_model
from engine_core.engine import EngineCore
from engine_core.sampling_params import SamplingParams
from engine_core.tokenizer import encode_chat, load_tokenizer

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5})
PROMPTS = json.loads((Path(__file__).parent / "data" / "spec_prompts.json").read_text())


def engine(speculate: bool) -> EngineCore:
    core = EngineCore(EngineConfig(model=str(ensure_default_model()), speculative_config=NGRAM if speculate else None))
    core.warm_up()
    return core


def one_stream(core: EngineCore, prompts: list[list[int]], new_tokens: int) -> dict:
    """Each prompt alone: decode tok/s over all of them (time after each first token)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    decode_seconds, decode_tokens = 0.0, 0
    for index, prompt in enumerate(prompts):
        core.add_request(f"s{index}", prompt, params)
        core.step()  # the prefill and first token
        started = time.perf_counter()
        while core.has_unfinished_requests():
            decode_tokens += sum(len(d.new_token_ids) for d in core.step())
        decode_seconds += time.perf_counter() - started
    return {"tok_s": decode_tokens / decode_seconds}


def batch(core: EngineCore, prompts: list[list[int]], new_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        core.add_request(f"b{index}", prompt, params)
    tokens, started = 0, time.perf_counter()
    while core.has_unfinished_requests():
        tokens += sum(len(d.new_token_ids) for d in core.step())
    return {"tok_s": tokens / (time.perf_counter() - started)}


def acceptance(before, after) -> tuple[float, float]:
    """(acceptance rate, mean acceptance length) between two counter snapshots."""
    if after is None:
        return 0.0, 1.0
    drafts = after.num_drafts - (before.num_drafts if before else 0)
    proposed = after.num_draft_tokens - (before.num_draft_tokens if before else 0)
    kept = after.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
    return kept / max(proposed, 1), 1 + kept / max(drafts, 1)


def snapshot(core: EngineCore):
    stats = core.stats().spec_decode
    return None if stats is None else type(stats)(**{f: getattr(stats, f) for f in stats.__struct_fields__})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    tokenizer = load_tokenizer(str(ensure_default_model()))

    def chat(text: str) -> list[int]:
        return encode_chat(tokenizer, [{"role": "user", "content": text}])

    workloads = {
        "copy": [chat(t) for t in PROMPTS["copy"]],
        "chat": [chat(t) for t in PROMPTS["chat"]],
    }
    rng = random.Random(0)
    batch_prompts = [[rng.randrange(100, 30000) for _ in range(128)] for _ in range(64)]
    engines = {False: engine(False), True: engine(True)}
    results: dict[tuple[str, bool], list[dict]] = {}
    for round_ in range(args.repeats):
        for name in (*workloads, "batch"):
            for speculate in (False, True):
                core = engines[speculate]
                before = snapshot(core)
                if name == "batch":
                    out = batch(core, batch_prompts, args.new_tokens)
                else:
                    out = one_stream(core, workloads[name], args.new_tokens)
                out["acceptance"], out["length"] = acceptance(before, snapshot(core))
                results.setdefault((name, speculate), []).append(out)
            off, on = results[(name, False)][-1], results[(name, True)][-1]
            print(
                f"  round {round_ + 1} {name:>5}: off {off['tok_s']:6.1f} tok/s, on {on['tok_s']:6.1f} tok/s "
                f"({on['tok_s'] / off['tok_s']:.2f}x), acceptance {on['acceptance']:.0%}, length {on['length']:.2f}",
                flush=True,
            )
    print("\nMedians (on / off in the same run):")
    print(f"  {'workload':>8} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>6} {'accepted':>9} {'length':>7}")
    for name in (*workloads, "batch"):
        off = statistics.median(r["tok_s"] for r in results[(name, False)])
        on = statistics.median(r["tok_s"] for r in results[(name, True)])
        rate = statistics.median(r["acceptance"] for r in results[(name, True)])
        length = statistics.median(r["length"] for r in results[(name, True)])
        print(f"  {name:>8} {off:10.1f} {on:10.1f} {on / off:6.2f} {rate:9.0%} {length:7.2f}")
    proposer = engines[True].proposer
    if proposer is not None and proposer.calls:
        print(f"  proposing: {1e6 * proposer.seconds / proposer.calls:.0f} us per step (all running requests)")


if __name__ == "__main__":
    main()
