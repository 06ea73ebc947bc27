"""Quantized test checkpoints made by the real tool, and HF transformers' answers on them.

The tool (llmcompressor, with transformers 5.17 and compressed-tensors) lives in its own venv,
.venv-llmcompressor (`make quant-tools`); its python runs the scripts in tests/quant_tools/ in a
subprocess. Checkpoints are written once into the model cache, `cache_root()/test-checkpoints/ct-<name>`,
and reused: each is written into a staging directory and renamed into place, so a half-written one
is never seen. Their names carry a hash of the scripts and pins that made them, so a change to either
makes new ones (and removes the stale ones). HF's answers on a checkpoint are kept beside it the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine_core.environment import cache_root

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tests" / "quant_tools"
TOOL_PYTHON = REPO / ".venv-llmcompressor" / "bin" / "python"
COMPLETE = ".pagoda-complete"
TINY_SOURCES = ("tiny-qwen2", "tiny-mistral")


def tool_python() -> Path:
    """The tool venv's python; a test needing it fails (never skips) when it is not there."""
    if not (TOOL_PYTHON.parent.parent / ".pagoda-tool-installed").exists():
        pytest.fail(f"the quantization tool venv is missing: run `make quant-tools` in {REPO}", pytrace=False)
    return TOOL_PYTHON


def _run_tool(script: str, *args: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [str(tool_python()), str(TOOLS / script), *args]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-4000:]}")


def _version() -> str:
    digest = hashlib.sha256()
    for path in (TOOLS / "make_checkpoint.py", TOOLS / "llmcompressor.txt"):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def checkpoint(source: str, scheme: str) -> Path:
    """The checkpoint of `source` ("smollm2" = the default model, or a tiny random model) quantized with
    `scheme` (tests/quant_tools/make_checkpoint.py), made on first use."""
    name = f"ct-{source}-{scheme}"  # (the directory is shared with other formats' test checkpoints)
    root = cache_root() / "test-checkpoints"
    target = root / f"{name}-{_version()}"
    if (target / COMPLETE).exists():
        return target
    if source == "smollm2":
        from engine_core.default_model import ensure_default_model

        source_arg = str(ensure_default_model())
    elif source in TINY_SOURCES:
        source_arg = source
    else:
        raise ValueError(f"unknown checkpoint source {source!r}")
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".staging-{name}-", dir=root))
    try:
        _run_tool("make_checkpoint.py", "--source", source_arg, "--scheme", scheme, "--out", str(staging))
        (staging / COMPLETE).write_text(f"{source} {scheme}\n")
        staging.rename(target)  # atomic: a half-written checkpoint is never visible
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for stale in root.glob(f"{name}-*"):
        if stale != target and stale.name.removeprefix(f"{name}-").isalnum():
            shutil.rmtree(stale, ignore_errors=True)
    return target


def hf_reference(
    model_dir: Path, prompts: list[list[int]], max_tokens: int, quantize_activations: bool = False
) -> tuple[list[list[int]], torch.Tensor]:
    """HF transformers on `model_dir` (decompressed by compressed-tensors): greedy tokens per prompt, EOS
    not stopping, and the first step's logits [prompts, vocab]. Activations stay in float unless asked.
    Kept beside the checkpoint, keyed by everything that determines it (inputs, script, pins)."""
    request = json.dumps([prompts, max_tokens, quantize_activations]).encode()
    key = hashlib.sha256(
        request + (TOOLS / "hf_reference.py").read_bytes() + (TOOLS / "llmcompressor.txt").read_bytes()
    )
    answer = model_dir / f"hf-reference-{key.hexdigest()[:16]}"
    if not (answer / COMPLETE).exists():
        staging = Path(tempfile.mkdtemp(prefix=".staging-hf-", dir=model_dir))
        try:
            prompts_file = staging / "prompts.json"
            prompts_file.write_text(json.dumps(prompts))
            args = ["--model", str(model_dir), "--prompts", str(prompts_file), "--max-tokens", str(max_tokens)]
            args += ["--out", str(staging)] + (["--quantize-activations"] if quantize_activations else [])
            _run_tool("hf_reference.py", *args)
            (staging / COMPLETE).write_text("")
            staging.rename(answer)  # atomic, as the checkpoints
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    tokens = json.loads((answer / "tokens.json").read_text())
    return tokens, load_file(str(answer / "logits.safetensors"))["logits"]


def ct_decompressed(model_dir: Path, modules: list[str]) -> dict[str, torch.Tensor]:
    """compressed-tensors' own decompression of these modules' weights (checkpoint names)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "weights.safetensors"
        _run_tool("ct_decompress.py", "--model", str(model_dir), "--modules", ",".join(modules), "--out", str(out))
        return load_file(str(out))
