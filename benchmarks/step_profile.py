"""Where one engine step's wall time goes: decode at batch 1, 16 and 64, a 512-token prefill, and
optionally mixed steps (`--mixed`: a decode batch plus two new prompts, a loaded server's usual step).

Drives a real `EngineCore` on the default SmolLM2 (fp32) in this process and splits each step into:
  schedule      Scheduler.schedule
  prepare       the rest of ModelRunner.submit: flat numpy inputs (`prepare_step`), logits rows
  to device     ModelRunner.to_device (numpy -> tensors, attention metadata)
  forward       the model's forward pass, split by op class (below)
  logits        the LM head (compute_logits)
  sampling      the rest of ModelRunner.finish: sampling batch, sampler, accepted tokens
  outputs       EngineCore._apply (tokens appended, stop checks, deltas) + msgspec encoding of the
                StepOutputs message + its send on a ZeroMQ PUSH socket (what core_proc does per step)
  other         the step's remaining wall time (engine.step bookkeeping)
The forward's op classes: fused layers (a decode step's decoder layers in one C call, the default
for CPU decode steps: engine_core/models/fused_decode.py; `--layered` turns it off, so that the other
classes split decode steps too), linear (every `Linear` call), attention (the attention layer: cache write
and paged attention), norm/rotary/act (`ops.rms_norm`, `fused_add_rms_norm`, `rotary_embedding`,
`silu_and_mul`), other (embedding, splits and reshapes, Python between the ops). Calls per layer count
those calls; "aten ops/layer" counts every torch op the forward dispatches (one pass, TorchDispatchMode).

Each case is run twice: once plain (the "step" column: wall time of engine.step + encode + send, no
timers inside; "cpu": the process CPU time of those steps, which other processes on the machine move
less than the wall time), then with the timers (wrappers around the functions above; their own cost shows as the
difference between the two step columns). Ratios between cases or against a change are only meaningful
within one run on this shared machine.

    OMP_NUM_THREADS=1 python -m benchmarks.step_profile --threads 1
    python -m benchmarks.step_profile --threads 2
    python -m benchmarks.step_profile --cases 1 16 --steps 30
    python -m benchmarks.step_profile --cases 1 --context 640 --prefill 0   (the 512 -> 256 workload's mid-point)
    python -m benchmarks.step_profile --threads 2 --layered   (decode steps layer by layer, split by op)
    python -m benchmarks.step_profile --threads 2 --cases --mixed 16 64 --prefill 0   (x16/x64 + 2 x 128)
(As a module, from the repository root, so that the packages it imports are found.)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import random
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import zmq
from torch.utils._python_dispatch import TorchDispatchMode

from pagoda.engine_core import protocol
from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.layers.attention import Attention
from pagoda.engine_core.layers.linear import Linear
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.kernels import ops
from pagoda.kernels.cpu.decoder import FusedDecoder

PHASES = ("schedule", "prepare", "to device", "forward", "logits", "sampling", "outputs", "other")
OP_CLASSES = ("fused layers", "linear", "attention", "norm/rotary/act", "other")
_NORM_ROTARY_ACT = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul")


class Timers:
    """Seconds and calls per name; `patch` wraps a function so that its wall time is added."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.in_forward = False  # op classes count only inside the model's forward (not the LM head)
        self._undo: list[tuple[object, str, object, bool]] = []

    def wrap(self, fn: Callable, name: str, forward_only: bool = False) -> Callable:
        clock = time.perf_counter

        def timed(*args, **kwargs):
            if forward_only and not self.in_forward:
                return fn(*args, **kwargs)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += clock() - start
                self.calls[name] += 1

        return timed

    def patch(self, owner: object, attr: str, name: str, forward_only: bool = False) -> None:
        had_own = attr in vars(owner)  # an instance attribute to restore, or a class one to drop
        original = getattr(owner, attr)
        self._undo.append((owner, attr, vars(owner).get(attr), had_own))
        setattr(owner, attr, self.wrap(original, name, forward_only))

    def restore(self) -> None:
        for owner, attr, original, had_own in reversed(self._undo):
            if had_own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)
        self._undo.clear()


@contextlib.contextmanager
def instrumented(engine: EngineCore, timers: Timers) -> Iterator[None]:
    runner = engine.runner
    model = runner.model
    timers.patch(engine.scheduler, "schedule", "schedule")
    timers.patch(runner, "submit", "submit")
    timers.patch(runner, "finish", "finish")
    timers.patch(runner, "to_device", "to device")
    timers.patch(model, "compute_logits", "logits")
    timers.patch(engine, "_apply", "apply")
    plain_forward = model.forward

    def forward(*args, **kwargs):
        timers.in_forward = True
        try:
            return plain_forward(*args, **kwargs)
        finally:
            timers.in_forward = False

    model.forward = timers.wrap(forward, "forward")
    timers.patch(FusedDecoder, "__call__", "fused layers", forward_only=True)
    timers.patch(Linear, "forward", "linear", forward_only=True)
    timers.patch(Attention, "forward", "attention", forward_only=True)
    for name in _NORM_ROTARY_ACT:
        timers.patch(ops, name, "norm/rotary/act", forward_only=True)
    try:
        yield
    finally:
        del model.forward
        timers.restore()


class OutputLink:
    """The engine core's per-step output path: encode a StepOutputs message, PUSH it to a reader."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.push = self.context.socket(zmq.PUSH)
        self.pull = self.context.socket(zmq.PULL)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.push.connect(f"tcp://127.0.0.1:{port}")

    def send(self, engine: EngineCore, deltas) -> None:
        frame = protocol.encoder.encode(protocol.StepOutputs(deltas, engine.stats(), time.time()))
        self.push.send(frame, copy=False)

    def drain(self) -> None:
        while self.pull.poll(0):
            self.pull.recv(copy=False)

    def close(self) -> None:
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.context.term()


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def aten_ops_per_layer(engine: EngineCore, link: OutputLink) -> float:
    """Torch ops one step's forward dispatches, per layer (a compiled C kernel is one ctypes call, not a
    torch op: those show in the call counts)."""
    model = engine.runner.model
    plain_forward = model.forward
    counter = OpCounter()

    def counted(*args, **kwargs):
        with counter:
            return plain_forward(*args, **kwargs)

    model.forward = counted
    try:
        _steps(engine, link, 1)
    finally:
        del model.forward
    return counter.count / engine.runner.num_layers


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(count)]


def _start_decodes(engine: EngineCore, batch: int, context: int, seed: int) -> None:
    """`batch` requests of `context` prompt tokens, prefilled, so that every following step is a pure
    decode step of `batch`."""
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    for i, prompt in enumerate(_prompts(batch, context, seed)):
        engine.add_request(f"d{seed}-{i}", prompt, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def _stop_all(engine: EngineCore) -> None:
    for request_id in list(engine.scheduler.requests):
        engine.abort_request(request_id)
    engine.reset_prefix_cache()


def _steps(engine: EngineCore, link: OutputLink, count: int, timers: Timers | None = None) -> float:
    """Run `count` steps, each with its outputs encoded and sent as core_proc does; their wall time.
    With `timers`, the encode+send time is added to them (as "send")."""
    total = 0.0
    for _ in range(count):
        start = time.perf_counter()
        deltas = engine.step()
        sent = time.perf_counter()
        link.send(engine, deltas)
        end = time.perf_counter()
        if timers is not None:
            timers.seconds["send"] += end - sent
        total += end - start
        link.drain()
    return total


def _row(timers: Timers, total: float, layers: int, count: int) -> dict[str, float]:
    """Milliseconds per step for each phase and op class, from timers summed over `count` steps."""
    s = timers.seconds
    row = {
        "step+": total,
        "schedule": s["schedule"],
        "prepare": s["submit"] - s["to device"] - s["forward"],
        "to device": s["to device"],
        "forward": s["forward"],
        "logits": s["logits"],
        "sampling": s["finish"] - s["logits"],
        "outputs": s["apply"] + s["send"],
        "fused layers": s["fused layers"],
        "linear": s["linear"],
        "attention": s["attention"],
        "norm/rotary/act": s["norm/rotary/act"],
    }
    row["other"] = total - sum(row[p] for p in PHASES if p != "other")
    row["op other"] = s["forward"] - sum(s[name] for name in OP_CLASSES[:-1])
    row = {k: v / count for k, v in row.items()}
    forwards = max(timers.calls["forward"], 1)
    for name in OP_CLASSES[:-1]:
        row[f"calls {name}"] = timers.calls[name] / forwards / layers
    return row


def _measured(engine: EngineCore, run: Callable[[Timers | None], float], count: int) -> tuple[float, float, dict]:
    """`run` (one step, or one request's steps; returns their wall time) `count` times plainly: the median
    wall time and the mean process CPU time; then `count` times under the timers: the per-phase row."""
    cpu_start = time.process_time()
    plain = [run(None) for _ in range(count)]
    cpu = (time.process_time() - cpu_start) / count
    timers = Timers()
    with instrumented(engine, timers):
        total = sum(run(timers) for _ in range(count))
    return statistics.median(plain), cpu, _row(timers, total, engine.runner.num_layers, count)


def decode_case(engine: EngineCore, link: OutputLink, batch: int, context: int, steps: int) -> dict:
    _start_decodes(engine, batch, context, seed=batch)
    _steps(engine, link, 3)  # warm-up
    step, cpu, row = _measured(engine, lambda timers: _steps(engine, link, 1, timers), steps)
    row["aten/layer"] = aten_ops_per_layer(engine, link)
    _stop_all(engine)
    return {"case": f"decode x{batch}", "step": step, "cpu": cpu, **row}


def mixed_case(engine: EngineCore, link: OutputLink, batch: int, context: int, prompts: int, steps: int) -> dict:
    """`batch` decoding requests, and in every step `prompts` new prompts of `context` tokens prefilled
    with them (each asks for one token, so it ends in its step): a loaded server's steady state, where
    finished requests' places are refilled as the others decode."""
    _start_decodes(engine, batch, context, seed=batch + 1)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    seeds = iter(range(20_000, 30_000))

    def step(timers: Timers | None = None) -> float:
        for prompt in _prompts(prompts, context, next(seeds)):
            engine.add_request(f"m{next(seeds)}", prompt, params)
        return _steps(engine, link, 1, timers)

    for _ in range(3):  # warm-up
        step()
    median, cpu, row = _measured(engine, step, steps)
    _stop_all(engine)
    return {"case": f"x{batch} + {prompts}x{context}", "step": median, "cpu": cpu, **row}


def prefill_case(engine: EngineCore, link: OutputLink, length: int, repeats: int) -> dict:
    """One request of `length` prompt tokens and one output token, from an empty prefix cache."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    seeds = iter(range(10_000, 20_000))

    def one_prefill(timers: Timers | None = None) -> float:
        engine.add_request(f"p{next(seeds)}", _prompts(1, length, next(seeds))[0], params)
        total = 0.0
        while engine.has_unfinished_requests():
            total += _steps(engine, link, 1, timers)
        engine.reset_prefix_cache()
        return total

    one_prefill()  # warm-up
    median, cpu, row = _measured(engine, one_prefill, repeats)
    return {"case": f"prefill {length}", "step": median, "cpu": cpu, **row}


def print_table(rows: list[dict], threads: int) -> None:
    ms = lambda v: f"{v * 1000:.2f}"  # noqa: E731
    print(
        f"\nms per step, {threads} thread(s); 'step' = plain run (median wall), 'cpu' = its mean process CPU time "
        "(all threads: less moved by other processes than wall time), 'step+' = with timers (mean wall)"
    )
    head = ["case", "step", "cpu", "step+", *PHASES]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["case"], ms(r["step"]), ms(r["cpu"]), ms(r["step+"]), *(ms(r[p]) for p in PHASES)]
        print("| " + " | ".join(cells) + " |")
    print("\nforward by op class, ms per step (calls per layer)")
    head = ["case", "forward", *OP_CLASSES, "aten ops/layer"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["case"], ms(r["forward"])]
        for name in OP_CLASSES[:-1]:
            cells.append(f"{ms(r[name])} ({r[f'calls {name}']:.2g})")
        cells.append(ms(r["op other"]))
        cells.append(f"{r['aten/layer']:.0f}" if "aten/layer" in r else "")
        print("| " + " | ".join(cells) + " |")


def read_bandwidth(threads: int) -> float:
    """Bytes per second this process reads from memory with `threads` torch threads: the best of five
    sums over 1 GiB of float32 (far above the caches), measured now, beside the steps."""
    data = torch.rand(2**28, dtype=torch.float32)  # (random: no page the kernel could share)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * data.element_size() / best


def print_bound(rows: list[dict], weight_bytes: int, bandwidth: float) -> None:
    """A decode step at batch 1 reads every weight once: weights / bandwidth is the least it can take."""
    bound = weight_bytes / bandwidth
    print(
        f"\nweight-read bound: {weight_bytes / 2**20:.0f} MiB of weights at {bandwidth / 1e9:.1f} GB/s "
        f"(measured in this run) = {bound * 1000:.2f} ms per token"
    )
    for r in rows:
        if r["case"] == "decode x1":
            print(f"decode x1 takes {r['step'] * 1000:.2f} ms: {bound / r['step']:.0%} of the bound's speed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model directory or GGUF file (default: the default model)")
    parser.add_argument("--quantization", default="auto", help="as pagoda serve's --quantization (e.g. int4)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--cases", type=int, nargs="*", default=[1, 16, 64], help="decode batch sizes")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per case")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding request")
    parser.add_argument("--prefill", type=int, default=512, help="prefill length (0: skip)")
    parser.add_argument("--repeats", type=int, default=3, help="timed prefills")
    parser.add_argument(
        "--mixed",
        type=int,
        nargs="*",
        default=[],
        help="batch sizes of mixed steps: that many decodes and two new prompts of --context tokens",
    )
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float16"], help="the KV cache's dtype")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block (default: engine's)")
    parser.add_argument(
        "--layered",
        action="store_true",
        help="decode layer by layer (PAGODA_DISABLE_FUSED_DECODE's path), to split it by op",
    )
    args = parser.parse_args()
    engine = EngineCore(
        EngineConfig(
            **({} if args.model is None else {"model": args.model}),
            quantization=args.quantization,
            num_threads=args.threads,
            kv_cache_memory=2 * 2**30,
            kv_cache_dtype=args.kv_cache_dtype,
            **({} if args.block_size is None else {"block_size": args.block_size}),
        )
    )
    engine.runner.model.fused_decode.enabled = not args.layered
    engine.warm_up()
    link = OutputLink()
    rows = []
    try:
        rows.extend(decode_case(engine, link, batch, args.context, args.steps) for batch in args.cases)
        rows.extend(mixed_case(engine, link, batch, args.context, 2, args.steps) for batch in args.mixed)
        if args.prefill:
            rows.append(prefill_case(engine, link, args.prefill, args.repeats))
        weight_bytes = engine.runner.weight_bytes
    finally:
        link.close()
        engine.close()
    print_table(rows, torch.get_num_threads())
    print_bound(rows, weight_bytes, read_bandwidth(torch.get_num_threads()))


if __name__ == "__main__":
    main()
