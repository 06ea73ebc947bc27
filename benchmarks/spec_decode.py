"""Speculative decoding (n-gram proposals, or --method draft_model with SmolLM2's first --draft-layers
layers as the draft) on and off, side by side, on the default model (SmolLM2, fp32), in-process
`EngineCore`s, the two cases alternating over --repeats rounds.

  copy     one stream at a time over the 20 bundled prompts whose answers copy spans of the prompt
           (repeat a text, rename a function, add a docstring: benchmarks/data/spec_prompts.json), each
           greedy answer to its end (EOS) or --new-tokens: decode tok/s, acceptance rate and mean
           acceptance length. --ignore-eos decodes past the answer's end, into text that copies nothing.
  chat     the same over 8 free-form chat prompts, where proposals rarely hold.
  batch    64 requests at once, 128 -> 128 (random token prompts): output tok/s, where speculation must
           stand down (--speculative-disable-batch-size) rather than slow the server.

    python -m benchmarks.spec_decode --repeats 2
    python -m benchmarks.spec_decode --method draft_model --draft-layers 10 --workloads copy,chat
    python -m benchmarks.spec_decode --method draft_model --draft q4_1 --workloads copy,chat
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.default_model import ensure_default_gguf, ensure_default_model
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.tokenizer import encode_chat, load_tokenizer

PROMPTS = json.loads((Path(__file__).parent / "data" / "spec_prompts.json").read_text())


def truncated_model(model_dir: Path, out_dir: Path, num_layers: int) -> Path:
    """A draft for `model_dir`: its first `num_layers` layers (embeddings, final norm and LM head kept), with
    its tokenizer, written to `out_dir`. Same vocabulary; it agrees with the whole model often enough to
    draft for it."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out_dir / "config.json").write_text(json.dumps(config))
    weights = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers:
                weights[name] = tensor
    save_file(weights, out_dir / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (model_dir / name).exists():
            (out_dir / name).write_bytes((model_dir / name).read_bytes())
    return out_dir


def engine(spec: str | None) -> EngineCore:
    core = EngineCore(EngineConfig(model=str(ensure_default_model()), speculative_config=spec))
    core.warm_up()
    return core


def one_stream(core: EngineCore, prompts: list[list[int]], new_tokens: int, ignore_eos: bool = False) -> dict:
    """Each prompt alone: decode tok/s over all of them (time after each first token)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=ignore_eos)
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


def speculative_config(args, model_dir: Path, scratch: Path) -> str:
    """The --speculative-config JSON the arguments ask for (a draft model is written under `scratch`)."""
    fields: dict = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.method == "draft_model" and args.draft == "q4_1":
        fields["model"] = str(ensure_default_gguf())
    elif args.method == "draft_model":
        fields["model"] = args.draft or str(truncated_model(model_dir, scratch / "draft", args.draft_layers))
    return json.dumps(fields)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--ignore-eos", action="store_true", help="copy and chat: decode past each answer's end")
    parser.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    parser.add_argument("--draft-layers", type=int, default=10, help="draft_model: the first N of SmolLM2's 30")
    parser.add_argument(
        "--draft", default=None, help="draft_model: this model instead (q4_1: the default model's Q4_1 GGUF file)"
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--workloads", default="copy,chat,batch", help="comma-separated: copy, chat, batch")
    parser.add_argument("--prompts", type=int, default=None, help="at most this many prompts per one-stream workload")
    args = parser.parse_args()
    model_dir = ensure_default_model()
    tokenizer = load_tokenizer(str(model_dir))

    def chat(text: str) -> list[int]:
        return encode_chat(tokenizer, [{"role": "user", "content": text}])

    names = args.workloads.split(",")
    workloads = {name: [chat(t) for t in PROMPTS[name]][: args.prompts] for name in ("copy", "chat") if name in names}
    rng = random.Random(0)
    batch_prompts = [[rng.randrange(100, 30000) for _ in range(128)] for _ in range(64)]
    scratch = tempfile.TemporaryDirectory()  # the draft's checkpoint, removed on exit
    spec = speculative_config(args, model_dir, Path(scratch.name))
    engines = {False: engine(None), True: engine(spec)}
    scratch.cleanup()  # (loaded)
    print(f"speculative config: {spec}", flush=True)
    results: dict[tuple[str, bool], list[dict]] = {}
    for round_ in range(args.repeats):
        for name in (*workloads, *(["batch"] if "batch" in names else [])):
            for speculate in (False, True):
                core = engines[speculate]
                before = snapshot(core)
                if name == "batch":
                    out = batch(core, batch_prompts, args.new_tokens)
                else:
                    out = one_stream(core, workloads[name], args.new_tokens, args.ignore_eos)
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
    for name in dict.fromkeys(name for name, _ in results):  # (in the order run)
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
