"""The fused CPU decode step against the layer-by-layer forward, in one process, steps interleaved.

A real `EngineCore` on the default SmolLM2 (fp32; or `--model` another, such as its Q4_1 GGUF, and
`--quantization int8|int4` at load) decodes batches of 1, 16 and 64 requests; rounds of
steps alternate between the fused path (every decoder layer in one C call: kernels/cpu/decoder.c) and
the layer-by-layer torch forward it replaces (`PAGODA_DISABLE_FUSED_DECODE=1` in a server), so that both
see the same machine load and the same growing contexts. Prints the median whole-step time of each
(engine.step with outputs encoded and sent, as core_proc does) and their ratio.

    python -m benchmarks.fused_decode --threads 2
    python -m benchmarks.fused_decode --threads 2 --cases 1 --context 640   (the 512 -> 256 workload's mid-point)
    python -m benchmarks.fused_decode --threads 2 --quantization int4
    python -m benchmarks.fused_decode --threads 2 --model gguf   (the default model's Q4_1 GGUF file)
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.step_profile import OutputLink, _start_decodes, _steps, _stop_all
from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore


def compare(engine: EngineCore, link: OutputLink, batch: int, context: int, rounds: int, steps: int) -> dict:
    seat = engine.runner.model.fused_decode
    _start_decodes(engine, batch, context, seed=batch)
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for fused in (True, False):  # warm-up of both
            seat.enabled = fused
            _steps(engine, link, 3)
        for _ in range(rounds):
            for fused in (True, False):
                seat.enabled = fused
                times[fused].extend(_steps(engine, link, 1) for _ in range(steps))
    finally:
        seat.enabled = True
        _stop_all(engine)
    fused, layered = (statistics.median(times[f]) * 1e3 for f in (True, False))
    return {"batch": batch, "fused": fused, "layered": layered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--cases", type=int, nargs="+", default=[1, 16, 64], help="decode batch sizes")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding request")
    parser.add_argument("--rounds", type=int, default=6, help="alternations of the two paths per case")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per path per round")
    parser.add_argument("--model", default=None, help="a model path, or 'gguf' (default: SmolLM2 in fp32)")
    parser.add_argument("--quantization", choices=["auto", "int8", "int4"], default="auto", help="int8|int4: at load")
    args = parser.parse_args()
    model = args.model
    if model == "gguf":
        from pagoda.engine_core.default_model import ensure_default_gguf

        model = str(ensure_default_gguf())
    extra = {"model": model} if model else {}
    engine = EngineCore(
        EngineConfig(num_threads=args.threads, kv_cache_memory=512 * 2**20, quantization=args.quantization, **extra)
    )
    engine.warm_up()
    link = OutputLink()
    try:
        rows = [compare(engine, link, b, args.context, args.rounds, args.steps) for b in args.cases]
    finally:
        link.close()
        engine.close()
    print(f"\nms per decode step (median), {torch.get_num_threads()} thread(s), context {args.context}:")
    print("| batch | fused (one C call) | layer by layer | layered / fused |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['fused']:.2f} | {r['layered']:.2f} | {r['layered'] / r['fused']:.2f}x |")


if __name__ == "__main__":
    main()
