"""GPTQ and AWQ test checkpoints, made by the real tools in their own venvs, and what those tools make of them.

GPTQModel (.venv-gptq) and AutoAWQ (.venv-awq) pin other versions of transformers than Pagoda's, so each
lives in a venv of its own, built by `make tool-venvs` from tests/quant_tools/<tool>.txt. The tests run
the scripts in tests/quant_tools with that venv's python:
- `make_gptq.py` / `make_awq.py` quantize a model directory (SmolLM2, or a tiny random model built here);
- `gptq_awq_hf_reference.py` (.venv-gptq: HF transformers loads both formats through GPTQModel) writes greedy
  tokens, first-step logprobs and, for GPTQ, GPTQModel's own dequantization of chosen layers;
- `awq_dequantize.py` (.venv-awq) writes AutoAWQ's own dequantization (`dequantize_gemm`) of chosen
  layers, or of every layer as a float32 model directory.

Checkpoints and tool outputs are kept in the model cache (`cache_root()/test-checkpoints/<name>`), keyed
by what made them (the tool's arguments and pinned requirements, the calibration, the source model, and
TOOLS_VERSION), and written atomically. Bump TOOLS_VERSION when a script in tests/quant_tools changes
what it writes for the same arguments.
Calibration uses a few texts bundled here (or random ids for a tiny model): nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine_core.environment import cache_root
from tests.helpers import PARAGRAPHS

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tests" / "quant_tools"
VENVS = {"gptq": REPO / ".venv-gptq", "awq": REPO / ".venv-awq"}
VENV_STAMP = ".pagoda-tool-installed"  # written by the Makefile once a tool venv is complete
MARKER = ".pagoda-checkpoint.json"
TOOLS_VERSION = 1
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

# Tiny random models (as in tests/engine_core/test_tiny_models.py): every input dimension a multiple of 128,
# so that AWQ's usual group of 128 applies, and 4 KV heads of 16 so that K/V have the 64 outputs AutoAWQ's
# clipping search needs at least; Qwen2 has QKV biases, Mistral a sliding window.
TINY_COMMON = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    initializer_range=0.25,
    tie_word_embeddings=False,
)
TINY_PROMPT_LENGTHS = (1, 5, 9, 16, 24, 33, 40, 57, 70, 90)  # around blocks and past Mistral's window of 24
SMOLLM2_PREFIX_LAYERS = 4


@dataclass(frozen=True)
class Spec:
    name: str  # directory under cache_root()/test-checkpoints
    tool: str  # "gptq" | "awq"
    source: str  # "smollm2" | "smollm2-4layers" | "tiny-qwen2" | "tiny-mistral"
    args: tuple[str, ...] = ()


def tool_python(tool: str) -> Path:
    venv = VENVS[tool]
    if not (venv / VENV_STAMP).exists():
        pytest.fail(
            f"the {tool} tool venv {venv} is missing or incomplete: run `make tool-venvs` "
            f"(it installs tests/quant_tools/{tool}.txt there)",
            pytrace=False,
        )
    return venv / "bin" / "python"


def run_tool(tool: str, workdir: Path, script: str, *args: object) -> None:
    """Run a script of tests/quant_tools in the tool's venv, in `workdir` (GPTQModel writes logs/ there)."""
    command = [str(tool_python(tool)), str(TOOLS / script), *map(str, args)]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",  # everything is local; no hub lookups from the tools
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
    }
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=workdir)
    if result.returncode != 0:
        tail = (result.stdout + result.stderr)[-4000:]
        pytest.fail(f"{' '.join(command)} exited with {result.returncode}:\n{tail}", pytrace=False)


def _fingerprint(*parts: object) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.read_bytes() if isinstance(part, Path) else json.dumps(part, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def _cached_dir(name: str, key: str, build) -> Path:
    """cache_root()/test-checkpoints/<name>, made by `build(staging_dir)` unless present with this key;
    built beside its final place and renamed into it, so a half-written one is never seen."""
    target = cache_root() / "test-checkpoints" / name
    marker = target / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("key") == key:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".staging-{name}-", dir=target.parent))
    try:
        build(staging / "out")
        (staging / "out" / MARKER).write_text(json.dumps({"key": key}))
        if target.exists():
            shutil.rmtree(target)
        (staging / "out").rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def source_model(source: str) -> Path:
    if source == "smollm2":
        from engine_core.default_model import ensure_default_model

        return ensure_default_model()
    if source == "smollm2-4layers":
        key = _fingerprint(SMOLLM2_PREFIX_LAYERS, source_model("smollm2") / ".pagoda-complete")
        return _cached_dir(f"gptq-awq-source-{source}", key, _build_smollm2_prefix)
    arch = source.removeprefix("tiny-")
    key = _fingerprint(TINY_COMMON, arch, 3)
    return _cached_dir(f"gptq-awq-source-{source}", key, lambda out: _build_tiny(arch, out))


def _build_smollm2_prefix(out: Path) -> None:
    """SmolLM2's first layers, its embeddings, final norm and tokenizer: real weights and dimensions (576,
    1536) for a tool too slow to quantize all 30 layers here (AutoAWQ: over 20 minutes on two busy cores)."""
    from safetensors.torch import load_file, save_file

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
    import transformers

    config_cls, extra = {
        "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
        "mistral": (transformers.MistralConfig, dict(sliding_window=24)),
    }[arch]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**{**TINY_COMMON, **extra}), dtype=torch.float32)
    if arch == "qwen2":  # make sure the QKV biases matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    if arch == "mistral":
        # Groups of positive weights only: asymmetric GPTQ gives them a zero point of 0, which a v1
        # checkpoint stores as -1 (the case where GPTQModel's whole-word subtraction borrows).
        with torch.no_grad():
            model.model.layers[0].self_attn.o_proj.weight.abs_()
            model.model.layers[0].mlp.up_proj.weight[:64].abs_()
    model.save_pretrained(out, safe_serialization=True)
    # GPTQModel loads a model's tokenizer even when given token ids (for Mistral it would otherwise build
    # a sentencepiece one): SmolLM2's, whose ids cover the tiny vocabulary's.
    smollm2 = source_model("smollm2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / name, out / name)


def calibration_ids(source: str) -> list[list[int]]:
    if source.startswith("smollm2"):
        from engine_core.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(source_model(source))
        return [tokenizer.encode(text) for text in CALIBRATION_TEXTS]
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(3, TINY_COMMON["vocab_size"], (48,), generator=generator).tolist() for _ in range(8)]


def prompt_ids(source: str) -> list[list[int]]:
    if source.startswith("smollm2"):
        from engine_core.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(source_model(source))
        return [tokenizer.encode(text) for text in PROMPT_TEXTS]
    generator = torch.Generator().manual_seed(1)
    return [
        torch.randint(3, TINY_COMMON["vocab_size"], (n,), generator=generator).tolist() for n in TINY_PROMPT_LENGTHS
    ]


def checkpoint(spec: Spec) -> Path:
    """The checkpoint `spec` describes, made by its tool on first use."""
    src = source_model(spec.source)
    script = TOOLS / f"make_{spec.tool}.py"
    calibration = calibration_ids(spec.source)
    source_marker = src / MARKER if (src / MARKER).exists() else src / ".pagoda-complete"  # the default model's
    key = _fingerprint(spec.args, calibration, TOOLS / f"{spec.tool}.txt", source_marker, TOOLS_VERSION)

    def build(out: Path) -> None:
        calibration_file = out.parent / "calibration.json"
        calibration_file.write_text(json.dumps(calibration))
        run_tool(spec.tool, out.parent, script.name, src, out, "--calibration", calibration_file, *spec.args)
        for name in TOKENIZER_FILES:  # AutoAWQ saves no tokenizer
            if (src / name).exists() and not (out / name).exists():
                shutil.copy(src / name, out / name)

    return _cached_dir(spec.name, key, build)


def tool_reference(spec: Spec, model_dir: Path, prompts: list[list[int]], max_tokens: int, layers: list[str]) -> dict:
    """What the tools make of `model_dir`: `tokens` and `first_logprobs`, HF transformers' greedy tokens and
    first-step logprobs (through GPTQModel's kernels); `dequantized`, the tool's own float32 dequantization
    of `layers` ({name: [out, in]}); for AWQ also `float32_dir`, the whole model dequantized by AutoAWQ."""
    script = TOOLS / "gptq_awq_hf_reference.py"
    model_key = json.loads((model_dir / MARKER).read_text())
    key = _fingerprint(prompts, max_tokens, layers, TOOLS / "gptq.txt", TOOLS / "awq.txt", model_key, TOOLS_VERSION)

    def build(out: Path) -> None:
        out.mkdir()
        (out / "prompts.json").write_text(json.dumps(prompts))
        dequantize = ",".join(layers) if spec.tool == "gptq" else ""
        run_tool(
            "gptq",
            out.parent,
            script.name,
            model_dir,
            out / "prompts.json",
            out / "reference.pt",
            "--max-tokens",
            max_tokens,
            "--dequantize",
            dequantize,
        )
        if spec.tool == "awq":
            run_tool("awq", out.parent, "awq_dequantize.py", model_dir, out / "awq", ",".join(layers))

    directory = _cached_dir(f"{spec.name}.reference", key, build)
    reference = torch.load(directory / "reference.pt")
    if spec.tool == "awq":
        reference["dequantized"] = torch.load(directory / "awq" / "dequantized.pt")
        reference["float32_dir"] = directory / "awq" / "float32"
    return reference
