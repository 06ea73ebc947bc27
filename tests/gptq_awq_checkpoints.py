"""GPTQ and AWQ test checkpoints, made by the real tools in their own venvs, and what those tools make of them
(the tool venvs, the runs and the cache: tests/tool_runs.py). The scripts of tests/quant_tools:
- `make_gptq.py` (.venv-gptq) / `make_awq.py` (.venv-awq) quantize a model directory (SmolLM2, its first
  layers, or a tiny random model of tests/tiny_models.py);
- `hf_reference.py` (.venv-gptq: HF transformers loads both formats through GPTQModel) writes greedy tokens,
  first-step logits and, for GPTQ, GPTQModel's own dequantization of chosen layers;
- `awq_dequantize.py` (.venv-awq) writes AutoAWQ's own dequantization (`dequantize_gemm`) of chosen
  layers, or of every layer as a float32 model directory.

Each is kept under its fixed name in cache_dir(), keyed by what made it (the tool's arguments and pinned
requirements, the calibration, the source model, TOOLS_VERSION: the scripts are not hashed), and made again
in place when that changes.
Calibration uses a few texts bundled here (or random ids for a tiny model): nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagoda.engine_core.default_model import COMPLETE_MARKER, ensure_default_model
from tests import tiny_models
from tests.helpers import PARAGRAPHS
from tests.tool_runs import KEYED, TOOLS, cache_dir, cached, fingerprint, run_tool

TOOLS_VERSION = 1  # in every key here: bump it when a script changes what it writes for the same arguments

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

# The golden prompts' paragraphs, and two of other kinds (code, a question), in this order (the order is
# part of what a checkpoint's cache key hashes).
CALIBRATION_TEXTS = [
    *PARAGRAPHS[:3],
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] <= b[0] else b.pop(0))\n"
    "    return out + a + b\n",
    "Question: Why do we have seasons?\nAnswer: Because the Earth is tilted on its axis, each hemisphere "
    "leans toward the Sun for part of the year and away from it for the rest.",
    *PARAGRAPHS[3:6],
]

PROMPT_TEXTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Question: Why is the sky blue?\nAnswer:",
    "List three colors: red,",
    "Once upon a time, in a village at the edge of a great forest, there lived",
    "The three states of matter are",
    "Translate to French: 'Good morning, how are you?'\n",
    CALIBRATION_TEXTS[1] + " In short, a cache",
    "Water boils at 100 degrees Celsius at sea level. At the top of a high mountain, it boils",
    "import numpy as np\n\nx = np.arange(10)\nprint(",
]

# Tiny random models (tests/tiny_models.py: every input dimension a multiple of 128, so that AWQ's usual group
# of 128 applies; Qwen2 has QKV biases, Mistral a sliding window) with 4 KV heads of 16, so that K/V have the
# 64 outputs AutoAWQ's clipping search needs at least.
TINY_OVERRIDES = dict(num_key_value_heads=4)
TINY_PROMPT_LENGTHS = (1, 5, 9, 16, 24, 33, 40, 57, 70, 90)  # around blocks and past Mistral's window of 24
SMOLLM2_PREFIX_LAYERS = 4


@dataclass(frozen=True)
class Spec:
    name: str  # directory under cache_dir()
    tool: str  # "gptq" | "awq"
    source: str  # "smollm2" | "smollm2-4layers" | "tiny-qwen2" | "tiny-mistral"
    args: tuple[str, ...] = ()


def smollm2(name: str, tool: str, *args: str) -> Spec:
    return Spec(name, tool, "smollm2", args)


# The checkpoints the tests use (test_gptq_awq.py; the tensor-parallel test reuses the act-order one).
SPECS = [
    # One GPTQ checkpoint of all of SmolLM2; the other variants quantize its first 4 layers (real weights and
    # widths): GPTQModel took 170-440 s for each of them on all 30 layers, 26 minutes of a cold test run.
    smollm2("gptq-smollm2-w4-g64", "gptq", "--bits", "4", "--group-size", "64"),
    Spec(
        "gptq-smollm2-4layers-w4-g64-asym", "gptq", "smollm2-4layers", ("--bits", "4", "--group-size", "64", "--asym")
    ),
    Spec(
        "gptq-smollm2-4layers-w4-g64-actorder",
        "gptq",
        "smollm2-4layers",
        ("--bits", "4", "--group-size", "64", "--desc-act"),
    ),
    Spec("gptq-smollm2-4layers-w8-g64", "gptq", "smollm2-4layers", ("--bits", "8", "--group-size", "64")),
    Spec("gptq-smollm2-4layers-w4-perchannel", "gptq", "smollm2-4layers", ("--bits", "4", "--group-size", "-1")),
    # AutoAWQ takes over 20 minutes on all of SmolLM2 here: its first 4 layers (576 and 1536 are not
    # multiples of 128, so groups of 64), and tiny models with AWQ's usual group of 128.
    Spec("awq-smollm2-4layers-g64", "awq", "smollm2-4layers", ("--group-size", "64")),
    Spec("gptq-tiny-qwen2-w4-g64", "gptq", "tiny-qwen2", ("--bits", "4", "--group-size", "64")),
    Spec("gptq-tiny-mistral-w4-g32-asym", "gptq", "tiny-mistral", ("--bits", "4", "--group-size", "32", "--asym")),
    Spec(
        "gptq-tiny-mistral-w4-g32-asym-v2",
        "gptq",
        "tiny-mistral",
        ("--bits", "4", "--group-size", "32", "--asym", "--format", "gptq_v2"),
    ),
    Spec("awq-tiny-qwen2-g128", "awq", "tiny-qwen2", ("--group-size", "128")),
    Spec("awq-tiny-mistral-g128", "awq", "tiny-mistral", ("--group-size", "128")),
]
BY_NAME = {spec.name: spec for spec in SPECS}


def source_model(source: str) -> Path:
    if source == "smollm2":
        return ensure_default_model()
    target = cache_dir() / f"gptq-awq-source-{source}"
    if source == "smollm2-4layers":
        key = fingerprint(SMOLLM2_PREFIX_LAYERS, source_model("smollm2") / COMPLETE_MARKER)
        return cached(target, _build_smollm2_prefix, key)
    arch = source.removeprefix("tiny-")
    # The key hashes the whole config dict (tiny_models.COMMON with the overrides: the values it always had).
    key = fingerprint({**tiny_models.COMMON, **TINY_OVERRIDES}, arch, 3)
    return cached(target, lambda out: _build_tiny(arch, out), key)


def _build_smollm2_prefix(out: Path) -> None:
    """SmolLM2's first layers, its embeddings, final norm and tokenizer: real weights and dimensions (576,
    1536) for a tool too slow to quantize all 30 layers here (AutoAWQ: over 20 minutes on two busy cores)."""
    smollm2 = source_model("smollm2")
    config = json.loads((smollm2 / "config.json").read_text())
    config["num_hidden_layers"] = SMOLLM2_PREFIX_LAYERS
    weights = load_file(str(smollm2 / "model.safetensors"))
    kept = {
        name: tensor
        for name, tensor in weights.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < SMOLLM2_PREFIX_LAYERS
    }
    out.mkdir()
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, out / name)


def _build_tiny(arch: str, out: Path) -> None:
    model = tiny_models.build(arch, **TINY_OVERRIDES)
    if arch == "mistral":
        # Groups of positive weights only: asymmetric GPTQ gives them a zero point of 0, which a v1
        # checkpoint stores as -1 (the case where GPTQModel's whole-word subtraction borrows).
        with torch.no_grad():
            model.model.layers[0].self_attn.o_proj.weight.abs_()
            model.model.layers[0].mlp.up_proj.weight[:64].abs_()
    model.save_pretrained(out)
    # GPTQModel loads a model's tokenizer even when given token ids (for Mistral it would otherwise build
    # a sentencepiece one): SmolLM2's, whose ids cover the tiny vocabulary's.
    smollm2 = source_model("smollm2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / name, out / name)


def calibration_ids(source: str) -> list[list[int]]:
    if source.startswith("smollm2"):
        from pagoda.engine_core.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(source_model(source))
        return [tokenizer.encode(text) for text in CALIBRATION_TEXTS]
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(3, tiny_models.COMMON["vocab_size"], (48,), generator=generator).tolist() for _ in range(8)]


def prompt_ids(source: str) -> list[list[int]]:
    if source.startswith("smollm2"):
        from pagoda.engine_core.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(source_model(source))
        return [tokenizer.encode(text) for text in PROMPT_TEXTS]
    generator = torch.Generator().manual_seed(1)
    return [
        torch.randint(3, tiny_models.COMMON["vocab_size"], (n,), generator=generator).tolist()
        for n in TINY_PROMPT_LENGTHS
    ]


def checkpoint(spec: Spec) -> Path:
    """The checkpoint `spec` describes, made by its tool on first use."""
    src = source_model(spec.source)
    calibration = calibration_ids(spec.source)
    source_marker = src / KEYED if (src / KEYED).exists() else src / COMPLETE_MARKER  # the default model's
    key = fingerprint(spec.args, calibration, TOOLS / f"{spec.tool}.txt", source_marker, TOOLS_VERSION)

    def build(out: Path) -> None:
        calibration_file = out.parent / "calibration.json"
        calibration_file.write_text(json.dumps(calibration))
        args = [src, out, "--calibration", calibration_file, *spec.args]
        run_tool(spec.tool, f"make_{spec.tool}.py", *args, cwd=out.parent)
        for name in TOKENIZER_FILES:  # AutoAWQ saves no tokenizer
            if (src / name).exists() and not (out / name).exists():
                shutil.copy(src / name, out / name)

    return cached(cache_dir() / spec.name, build, key)


def tool_reference(spec: Spec, model_dir: Path, prompts: list[list[int]], max_tokens: int, layers: list[str]) -> dict:
    """What the tools make of `model_dir`: `tokens` and `first_logprobs`, HF transformers' greedy tokens and
    first-step logprobs (through GPTQModel's kernels); `dequantized`, the tool's own float32 dequantization
    of `layers` ({name: [out, in]}); for AWQ also `float32_dir`, the whole model dequantized by AutoAWQ."""
    model_key = json.loads((model_dir / KEYED).read_text())
    key = fingerprint(prompts, max_tokens, layers, TOOLS / "gptq.txt", TOOLS / "awq.txt", model_key, TOOLS_VERSION)
    dequantize = layers if spec.tool == "gptq" else []  # AWQ's: AutoAWQ's own, below

    def build(out: Path) -> None:
        out.mkdir()
        (out / "prompts.json").write_text(json.dumps(prompts))
        hf = out.parent / "hf"
        args = ["--model", model_dir, "--prompts", out / "prompts.json", "--max-tokens", max_tokens, "--out", hf]
        args += ["--dequantize", ",".join(dequantize)] if dequantize else []
        run_tool("gptq", "hf_reference.py", *args, cwd=out.parent)
        # reference.pt holds what the tests read: the tokens, the first step's logprobs, the dequantized layers
        dequantized = load_file(str(hf / "dequantized.safetensors")) if dequantize else {}
        reference = {
            "tokens": json.loads((hf / "tokens.json").read_text()),
            "first_logprobs": torch.log_softmax(load_file(str(hf / "logits.safetensors"))["logits"], dim=-1),
            "dequantized": {name: dequantized[name] for name in dequantize},
        }
        torch.save(reference, out / "reference.pt")
        if spec.tool == "awq":
            run_tool("awq", "awq_dequantize.py", model_dir, out / "awq", ",".join(layers), cwd=out.parent)

    directory = cached(cache_dir() / f"{spec.name}.reference", build, key)
    reference = torch.load(directory / "reference.pt")
    if spec.tool == "awq":
        reference["dequantized"] = torch.load(directory / "awq" / "dequantized.pt")
        reference["float32_dir"] = directory / "awq" / "float32"
    return reference
