"""Hybrid models: the KV memory Pagoda's KV groups save on Gemma 3's sliding-window pattern, and long-context
decode speed on a Qwen3.5-shaped model (Gated DeltaNet + full attention), each side by side in one run.

`memory`: random weights (`load_format="dummy"`) with Gemma 3's real text widths (`--size 1b`: hidden 1152,
4 query / 1 KV head of 256, window 512; `--size 4b`: hidden 2560, 8 / 4 heads of 256, window 1024) and one
or two periods of its layer pattern (`--periods`: 6 or 12 layers, five sliding to one full each, instead of
26 or 34: the ratio only depends on the pattern). One request of `--context` prompt tokens runs through a
real EngineCore (chunked prefill of `--chunk` tokens, then `--decode-steps` decode steps), once with
Pagoda's KV groups (sliding groups give back the blocks that leave the window) and once with the same model
made all-global (`layer_types` all "full_attention"). Printed: the blocks the request holds at the end
(`kv_manager.num_blocks_held`) x bytes per block (from the runner's KV pool tensor), the peak during
prefill, what the formula predicts (full layers: every block of the context; sliding layers: the blocks
that the window of the last token overlaps), the ideal token count (full: context, sliding: window) and
the grouped / global ratio (issue 38's target: <= 0.3).

`speed`: a Qwen3.5-shaped checkpoint (transformers' Qwen3_5TextConfig defaults: hidden 4096, MLP 12288,
16 query / 4 KV heads of 256, Gated DeltaNet with 16 key / 32 value heads of 128; `--layers` of them in its
pattern, 3 linear + 1 full by default; SmolLM2's 49,152-token vocabulary so that the checkpoint stays
5 GB in float32), written once into the model cache by transformers. Decode tok/s at `--context` tokens
of context, one stream and 16 streams: Pagoda's EngineCore (pure decode steps after every prompt is
prefilled), HF transformers `generate` on the same checkpoint (from its first generated token to its last,
timed by a streamer), and with `--vllm-venv` vLLM's CPU build (0.32 serves Qwen3_5ForCausalLM: its
registry lists it and its CPU platform has a GDN state backend, in bfloat16 only), over HTTP as
benchmarks/moe.py measures it: streams x 1000 / TPOT p50, which counts the steps where other prompts'
prefill chunks ride along. `--dtype bfloat16` runs every system in bfloat16 (vLLM fails in float32: "CPU
GDN attention requires BF16"). A system that cannot run the model is reported, not fatal. Heavy: 16
prompts of 8k tokens are prefilled by each system (tens of minutes on 2 cores); `--context 512 --steps 4`
is a smoke run.

    python -m benchmarks.hybrid memory                          # Gemma 3 1B widths, 6 layers, 16k context
    python -m benchmarks.hybrid memory --context 4096           # quick mode (smoke run)
    python -m benchmarks.hybrid memory --size 4b --periods 2    # Gemma 3 4B widths, 12 layers
    python -m benchmarks.hybrid speed                           # 8k context, 1 and 16 streams
    python -m benchmarks.hybrid speed --vllm-venv .peers/vllm --dtype bfloat16   # and vLLM's CPU build
    python -m benchmarks.hybrid speed --context 512 --steps 4 --streams 1 2   # smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.request import Request
from pagoda.engine_core.sampling_params import SamplingParams

BLOCK_SIZE = 16

# Gemma 3's text models (their released config.json values; the layer pattern: five sliding, one full).
GEMMA3 = {
    "1b": dict(
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=512,
        max_position_embeddings=32768,
        rope_scaling=None,
    ),
    "4b": dict(
        vocab_size=262208,
        hidden_size=2560,
        intermediate_size=10240,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        sliding_window=1024,
        max_position_embeddings=131072,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
}
GEMMA3_PATTERN = 6  # sliding_window_pattern: every sixth layer is global
GEMMA3_LAYERS = {"1b": 26, "4b": 34}  # (the released models' num_hidden_layers)


def cpu_name() -> str:
    """The CPU's model name, as lscpu prints it."""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


# --- memory ----------------------------------------------------------------------------------------------


def gemma3_config(size: str, periods: int, all_global: bool) -> dict:
    layers = GEMMA3_PATTERN * periods
    kinds = ["full_attention" if (i + 1) % GEMMA3_PATTERN == 0 else "sliding_attention" for i in range(layers)]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": layers,
        "layer_types": ["full_attention"] * layers if all_global else kinds,
        "sliding_window_pattern": GEMMA3_PATTERN,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "torch_dtype": "float32",
        **GEMMA3[size],
    }


def predicted_blocks(layer_types: list[str], window: int, position: int) -> int:
    """Blocks (one per layer) that a request holds after computing the token at `position`: a full layer
    keeps every block up to it; a sliding layer only those from the one its window starts in (the token
    sees keys from position + 1 - window on: engine_core/kv_cache.py)."""
    last = position // BLOCK_SIZE
    first_in_window = max(0, (position + 1 - window) // BLOCK_SIZE)
    return sum(last + 1 if kind == "full_attention" else last - first_in_window + 1 for kind in layer_types)


def describe_groups(groups) -> str:
    """`KVLayout.groups` counted by kind: "5 sliding 512, 1 full (1 layer(s) each)"."""
    counts: dict[str, int] = {}
    for group in groups:
        kind = "full" if group.window is None else f"sliding {group.window}"
        counts[kind] = counts.get(kind, 0) + 1
    sizes = {len(group.layers) for group in groups}
    each = f"{sizes.pop()} layer(s) each" if len(sizes) == 1 else "layers: " + "/".join(map(str, sorted(sizes)))
    return ", ".join(f"{n} {kind}" for kind, n in counts.items()) + f" ({each})"


def measure_kv(config: dict, context: int, chunk: int, decode_steps: int, threads: int | None) -> dict:
    """Run one request of `context` prompt tokens through an engine built from `config`: the blocks it
    holds after prefill and `decode_steps` decode steps, at its peak, and the pool's bytes per block."""
    layers, kv_heads, head_dim = config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]
    room = context + decode_steps + 2 * chunk + 64
    # A pool for the all-global model's whole request (and chunk) with a margin: fp32 K and V of every layer.
    pool_bytes = int(1.25 * room * layers * 2 * kv_heads * head_dim * 4)
    with tempfile.TemporaryDirectory(prefix="pagoda-hybrid-") as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(config))
        engine = EngineCore(
            EngineConfig(
                model=model_dir,
                load_format="dummy",
                dtype="float32",
                block_size=BLOCK_SIZE,
                kv_cache_memory=pool_bytes,
                max_model_len=context + decode_steps + 16,
                max_num_batched_tokens=chunk,
                enable_prefix_caching=False,
                num_threads=threads,
            )
        )
    try:
        kv_cache = engine.runner.kv_cache
        assert kv_cache is not None
        # [slots, K/V, blocks, block size x row]: one block id holds a K and V per slot
        bytes_per_block = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        # (more tokens than measured: a request that reaches max_tokens is freed within that step)
        params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 8, ignore_eos=True)
        engine.add_request("long", random_prompt(context, config["vocab_size"], seed=0), params)
        request: Request = engine.scheduler.requests["long"]
        started = time.perf_counter()
        peak = after_prefill = 0
        prefill_seconds = 0.0
        while request.num_output_tokens < decode_steps + 1:
            engine.step()
            held = engine.kv_manager.num_blocks_held(request)
            peak = max(peak, held)
            if request.num_output_tokens == 1 and not after_prefill:
                after_prefill, prefill_seconds = held, time.perf_counter() - started
        held = engine.kv_manager.num_blocks_held(request)
        last_position = request.num_computed_tokens - 1
        engine.abort_request("long")
        return {
            "layout": describe_groups(engine.runner.kv_layout.groups),
            "bytes_per_block": bytes_per_block,
            "slots": kv_cache.shape[0],
            "held": held,
            "after_prefill": after_prefill,
            "peak": peak,
            "prefill_s": prefill_seconds,
            "last_position": last_position,
            "layer_bytes_per_block": 2 * BLOCK_SIZE * kv_heads * head_dim * kv_cache.element_size(),
        }
    finally:
        engine.close()
        del engine
        gc.collect()


def cmd_memory(args: argparse.Namespace) -> None:
    grouped_cfg = gemma3_config(args.size, args.periods, all_global=False)
    global_cfg = gemma3_config(args.size, args.periods, all_global=True)
    window, layers = grouped_cfg["sliding_window"], grouped_cfg["num_hidden_layers"]
    print(
        f"Gemma 3 {args.size.upper()} text widths, random weights, {layers} layers ({args.periods} period(s) of "
        f"{GEMMA3_PATTERN}: 5 sliding (window {window}) + 1 full; the real model has {GEMMA3_LAYERS[args.size]}), "
        "fp32 KV, "
        f"block {BLOCK_SIZE}; one request of {args.context} prompt tokens, prefill chunks of {args.chunk}, "
        f"then {args.decode_steps} decode steps; {cpu_name()}, {torch.get_num_threads()} threads",
        flush=True,
    )
    rows = {}
    for name, config in (("Pagoda KV groups", grouped_cfg), ("every layer global", global_cfg)):
        print(f"running {name} ...", flush=True)
        rows[name] = measure_kv(config, args.context, args.chunk, args.decode_steps, args.threads)
        rows[name]["predicted"] = predicted_blocks(config["layer_types"], window, rows[name]["last_position"])
    print(f"\nKV memory one request holds after prefill + {args.decode_steps} decode steps (MiB = 2^20 bytes):")
    print("| layout | KV groups | blocks held | bytes/block | KV MiB | formula MiB | peak (prefill) MiB | prefill s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        mib = r["held"] * r["bytes_per_block"] / 2**20
        # (the formula counts one block per layer; a block id holds `slots` layers of a group)
        formula = r["predicted"] * r["layer_bytes_per_block"] / 2**20
        peak = r["peak"] * r["bytes_per_block"] / 2**20
        print(
            f"| {name} | {r['layout']} | {r['held']} | {r['bytes_per_block']:,} | {mib:.1f} | {formula:.1f} "
            f"| {peak:.1f} | {r['prefill_s']:.0f} |"
        )
    grouped, full = rows["Pagoda KV groups"], rows["every layer global"]
    grouped_bytes = grouped["held"] * grouped["bytes_per_block"]
    full_bytes = full["held"] * full["bytes_per_block"]
    tokens = full["last_position"] + 1
    ideal = (layers // GEMMA3_PATTERN * tokens + (layers - layers // GEMMA3_PATTERN) * window) / (layers * tokens)
    print(f"\ngrouped / all-global: {grouped_bytes / full_bytes:.3f} (target <= 0.3)")
    print(f"ideal, tokens kept (full layers: {tokens}, sliding: {window}): {ideal:.3f}")
    matches = all(r["held"] * r["slots"] == r["predicted"] for r in rows.values())
    print(f"blocks held match the formula: {'yes' if matches else 'NO'}")


# --- speed -----------------------------------------------------------------------------------------------

QWEN3_5_VOCAB = 49152  # SmolLM2's tokenizer (copied beside the weights, for vLLM's server)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def qwen3_5_dir(layers: int) -> Path:
    from pagoda.engine_core.environment import cache_root

    return cache_root() / "bench-models" / f"qwen3_5-shapes-{layers}-layers"


def ensure_qwen3_5(layers: int) -> Path:
    """The Qwen3.5-shaped checkpoint (safetensors, float32), written once by transformers."""
    target = qwen3_5_dir(layers)
    if target.exists():
        return target
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from pagoda.engine_core.default_model import ensure_default_model

    print(f"writing {target} (once) ...", flush=True)
    config = Qwen3_5TextConfig(
        vocab_size=QWEN3_5_VOCAB,
        num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).to(torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        source = ensure_default_model()
        for name in TOKENIZER_FILES:
            if (source / name).exists():
                shutil.copy(source / name, staging / name)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def pagoda_decode(
    model: Path, context: int, cases: list[int], steps: int, threads: int | None, dtype: str = "float32"
) -> dict[int, float]:
    """Decode tok/s of `streams` requests at `context` tokens: pure decode steps, every prompt prefilled."""
    engine = EngineCore(
        EngineConfig(
            model=str(model),
            dtype=dtype,
            kv_cache_memory=2 * 2**30,
            max_model_len=context + steps + 32,
            max_num_seqs=max(cases),
            enable_prefix_caching=False,
            num_threads=threads,
        )
    )
    try:
        engine.warm_up()
        result = {}
        for streams in cases:
            params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
            for i in range(streams):
                engine.add_request(f"s{streams}-{i}", random_prompt(context, QWEN3_5_VOCAB, seed=i), params)
            while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
                engine.step()
            engine.step()  # (a first pure decode step, untimed)
            started = time.perf_counter()
            for _ in range(steps):
                engine.step()
            result[streams] = streams * steps / (time.perf_counter() - started)
            for request_id in list(engine.scheduler.requests):
                engine.abort_request(request_id)
        return result
    finally:
        engine.close()
        del engine
        gc.collect()


class TokenTimes:
    """A `generate` streamer that notes when each step's tokens arrive (the first call is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_decode(model_dir: Path, context: int, cases: list[int], steps: int, dtype: str = "float32") -> dict[int, float]:
    """HF `generate`'s decode tok/s: its generated tokens after the first, over the time from the first."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    result = {}
    try:
        for streams in cases:
            ids = torch.tensor([random_prompt(context, QWEN3_5_VOCAB, seed=i) for i in range(streams)])
            streamer = TokenTimes()
            with torch.inference_mode():
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=steps + 1,
                    min_new_tokens=steps + 1,
                    do_sample=False,
                    streamer=streamer,
                )
            first, last = streamer.times[1], streamer.times[-1]  # (times[0]: the prompt, before prefill)
            result[streams] = streams * steps / (last - first)
    finally:
        del model
        gc.collect()
    return result


def vllm_decode(
    venv: Path, model: Path, context: int, cases: list[int], steps: int, dtype: str = "float32"
) -> dict[int, float]:
    """vLLM's CPU server (benchmarks/peers/vllm_cpu.sh), as benchmarks/moe.py drives it: streams x 1000 /
    TPOT p50 of `streams` concurrent requests."""
    from benchmarks.moe import _vllm
    from pagoda.api_proc.bench.datasets import as_text, random_requests
    from pagoda.engine_core.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    # (moe.py's helper takes its warm-up request from the workload named "one")
    names = {streams: "one" if i == 0 else str(streams) for i, streams in enumerate(cases)}
    workloads = {
        names[streams]: (as_text(random_requests(streams, context, steps, seed=streams), tokenizer), streams)
        for streams in cases
    }
    os.environ["MAX_MODEL_LEN"] = str(context + steps + 256)  # (text round trips may add a few tokens)
    os.environ["DTYPE"] = dtype
    rows = _vllm(venv, model, workloads)
    return {streams: streams * rows[names[streams]]["decode_tok_s"] for streams in cases}


def cmd_speed(args: argparse.Namespace) -> None:
    model = ensure_qwen3_5(args.layers)
    kinds = ", ".join(json.loads((model / "config.json").read_text())["layer_types"])
    print(
        f"Qwen3.5 widths (Qwen3_5TextConfig defaults), random weights, {args.layers} layers ({kinds}), "
        f"vocabulary {QWEN3_5_VOCAB}, {args.dtype}; decode at {args.context} tokens of context, {args.steps} timed "
        f"steps; {cpu_name()}, {torch.get_num_threads()} threads",
        flush=True,
    )
    plan = [
        (
            "Pagoda EngineCore",
            lambda: pagoda_decode(model, args.context, args.streams, args.steps, args.threads, args.dtype),
        ),
        ("HF transformers generate", lambda: hf_decode(model, args.context, args.streams, args.steps, args.dtype)),
    ]
    if args.vllm_venv is not None:
        plan.append(
            (
                "vLLM-cpu (TPOT)",
                lambda: vllm_decode(args.vllm_venv, model, args.context, args.streams, args.steps, args.dtype),
            )
        )
    rows: dict[str, dict[int, float]] = {}
    for name, measure in plan:
        print(f"measuring {name} ...", flush=True)
        try:
            rows[name] = measure()
        except Exception as exc:  # noqa: BLE001 - a system that cannot run the model is reported, not fatal
            print(f"  {name} could not run: {type(exc).__name__}: {exc}", flush=True)
    print("\ndecode tok/s (all streams together):")
    print("| system | " + " | ".join(f"{s} stream(s)" for s in args.streams) + " |")
    print("|---|" + "---|" * len(args.streams))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[s]:.1f}" if s in row else "n/a" for s in args.streams) + " |")
    pagoda = rows.get("Pagoda EngineCore")
    for name, row in rows.items():
        if pagoda is not None and row is not pagoda:
            ratios = ", ".join(f"{s}: {pagoda[s] / row[s]:.2f}x" for s in args.streams if s in row and s in pagoda)
            print(f"Pagoda / {name}: {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    sub = parser.add_subparsers(dest="command", required=True)
    memory = sub.add_parser("memory", help="KV memory of one long request: KV groups against all-global")
    memory.add_argument("--size", choices=sorted(GEMMA3), default="1b", help="Gemma 3's text widths")
    memory.add_argument("--periods", type=int, default=1, help="periods of 6 layers (5 sliding + 1 full)")
    memory.add_argument("--context", type=int, default=16384, help="prompt tokens (4096: quick mode)")
    memory.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens: prefill chunk")
    memory.add_argument("--decode-steps", type=int, default=4, help="decode steps after the prefill")
    speed = sub.add_parser("speed", help="long-context decode tok/s on a Qwen3.5-shaped model")
    speed.add_argument("--layers", type=int, default=4, help="layers: three linear, then one full, repeated")
    speed.add_argument("--context", type=int, default=8192, help="prompt tokens of each stream")
    speed.add_argument("--streams", type=int, nargs="+", default=[1, 16], help="concurrent streams per case")
    speed.add_argument("--steps", type=int, default=32, help="timed decode steps per case")
    speed.add_argument("--vllm-venv", type=Path, help="vLLM's CPU venv (benchmarks/peers/vllm_cpu.sh makes one)")
    speed.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="every system's (vLLM 0.32's CPU Gated DeltaNet runs bfloat16 only)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.command == "memory":
        cmd_memory(args)
    else:
        cmd_speed(args)


if __name__ == "__main__":
    main()
