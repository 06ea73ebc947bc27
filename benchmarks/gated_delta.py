"""Gated DeltaNet's decode step (Qwen3.5/3.6's linear-attention layers): the dispatched kernels against the torch
reference, at Qwen3.5's head counts and dims (Qwen3_5TextConfig's defaults: 16 key heads and 32 value heads of
128, conv kernel 4), batch 1 and 16, and one prompt's prefill.

One step is what a layer runs between its projections: the gating (g, beta from a, b), the causal conv1d
over q/k/v's channels with its state, the delta rule with its state (each sequence its own slot in a pool, so
batch 16 moves 16 x 2 MiB of state per layer), and the gated output norm. The C kernels run the delta rule
token by token also in prefill, where the reference runs HF's chunked form: the prefill line says what
that costs. Each line prints both times, reference / kernel, and the kernel's state traffic (each sequence's
state read and written once) per second, to set against the machine's memory bandwidth. Times are medians;
compare within one run.

    python -m benchmarks.gated_delta                    # CPU: C kernels (CUDA: Triton) against the reference
    python -m benchmarks.gated_delta --iterations 3     # a smoke run
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from transformers import Qwen3_5TextConfig

from pagoda.kernels import ops
from pagoda.kernels.ops import _TORCH, implementation

_OPS = ("gdn_gating", "causal_conv1d", "gated_delta_rule", "rms_norm_gated")


def median_seconds(fn: Callable[[], object], device: torch.device, iterations: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def layer_step(lengths: list[int], device: torch.device, pick: Callable[[str], Callable]) -> Callable[[], object]:
    """One linear-attention layer's kernels for sequences of `lengths` new tokens, through `pick`'s ops."""
    config = Qwen3_5TextConfig()
    key_heads, key_dim = config.linear_num_key_heads, config.linear_key_head_dim
    value_heads, value_dim = config.linear_num_value_heads, config.linear_value_head_dim
    width = config.linear_conv_kernel_dim
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    tokens, batch = sum(lengths), len(lengths)
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=gen, device=device)

    mixed, z, a, b = (
        randn(tokens, channels),
        randn(tokens, value_heads * value_dim),
        randn(tokens, value_heads),
        randn(tokens, value_heads),
    )
    weight, a_log, dt_bias, norm_weight = (
        randn(channels, width),
        randn(value_heads),
        randn(value_heads),
        randn(value_dim),
    )
    conv_states = randn(batch, width - 1, channels)
    states = randn(batch, value_heads, key_dim, value_dim, scale=0.1)
    cu_seqlens = torch.tensor([0, *lengths], device=device).cumsum(0)
    slots = torch.arange(batch, device=device)
    key_size = key_heads * key_dim

    def step() -> torch.Tensor:
        g, beta = pick("gdn_gating")(a, b, a_log, dt_bias)
        qkv = pick("causal_conv1d")(mixed, weight, None, conv_states, cu_seqlens, slots, "silu")
        query = qkv[:, :key_size].view(tokens, key_heads, key_dim)
        key = qkv[:, key_size : 2 * key_size].view(tokens, key_heads, key_dim)
        value = qkv[:, 2 * key_size :].view(tokens, value_heads, value_dim)
        out = pick("gated_delta_rule")(query, key, value, g, beta, states, cu_seqlens, slots)
        return pick("rms_norm_gated")(out, z.view(tokens, value_heads, value_dim), norm_weight, 1e-6)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=200, help="timed calls per line (decode)")
    parser.add_argument("--prompt", type=int, default=512, help="prefill tokens of the prefill line")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernel_kind = "Triton" if device.type == "cuda" else "C"
    kinds = {name: ("compiled" if ops.compiled(name, device) else "reference") for name in _OPS}
    print(f"device {device.type}, threads {torch.get_num_threads()}, ops: {kinds}")
    workloads = [("decode, batch 1", [1], args.iterations), ("decode, batch 16", [1] * 16, args.iterations)]
    workloads.append((f"prefill, {args.prompt} tokens", [args.prompt], max(1, args.iterations // 50)))
    config = Qwen3_5TextConfig()
    state_bytes = 4 * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    print(f"{'one layer':<24} {'reference ms':>13} {kernel_kind + ' ms':>9} {'ratio':>7} {'state GB/s':>11}")
    for label, lengths, iterations in workloads:
        reference = median_seconds(layer_step(lengths, device, lambda name: _TORCH[name]), device, iterations)
        kernel = median_seconds(
            layer_step(lengths, device, lambda name: implementation(name, device)), device, iterations
        )
        bandwidth = 2 * state_bytes * len(lengths) / kernel / 1e9  # (each sequence's state read and written once)
        print(
            f"{label:<24} {reference * 1e3:>13.3f} {kernel * 1e3:>9.3f} {reference / kernel:>6.2f}x {bandwidth:>11.1f}"
        )


if __name__ == "__main__":
    main()
