"""compressed-tensors and FP8 test checkpoints, made by the real tool (llmcompressor, and transformers' FP8 op)
in .venv-llmcompressor, HF transformers' answers on them, and compressed-tensors' own decompression. The tool
venvs, the runs and the cache: tests/tool_runs.py.

A checkpoint is `ct-<source>-<scheme>-<key>` under cache_dir(), its key in its name, so that a new one never
replaces one a running test reads; older ones of the same source and scheme are removed once it is made.
HF's answers on it are kept inside it, in `hf-reference-<key>`. Keys hash the script that makes the output
and the tool's pins (and the request), so that a change to either makes new ones.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests import tiny_models
from tests.tool_runs import COMPLETE, TOOLS, cache_dir, cached, fingerprint, run_tool

TINY_SOURCES = {"tiny-qwen2": "qwen2", "tiny-mistral": "mistral"}  # source -> tests/tiny_models.py's name
PINS = TOOLS / "llmcompressor.txt"


def _key(*inputs: object, length: int = 16) -> str:
    return fingerprint(*inputs, PINS)[:length]


def checkpoint(source: str, scheme: str) -> Path:
    """The checkpoint of `source` ("smollm2" = the default model, or a tiny random model) quantized with
    `scheme` (tests/quant_tools/make_checkpoint.py), made on first use."""
    if source != "smollm2" and source not in TINY_SOURCES:
        raise ValueError(f"unknown checkpoint source {source!r}")
    name = f"ct-{source}-{scheme}"  # (the directory is shared with other formats' test checkpoints)
    target = cache_dir() / f"{name}-{_key(TOOLS / 'make_checkpoint.py', length=10)}"

    def build(out: Path) -> None:
        if source == "smollm2":
            from pagoda.engine_core.default_model import ensure_default_model

            source_dir = ensure_default_model()
        else:
            source_dir = out.parent / source  # oneshot wants a saved model
            tiny_models.build(TINY_SOURCES[source]).save_pretrained(source_dir)
        args = ["--source", source_dir, "--scheme", scheme, "--out", out]
        run_tool("llmcompressor", "make_checkpoint.py", *args, cwd=out.parent)

    if (target / COMPLETE).exists():
        return target
    cached(target, build)
    for stale in target.parent.glob(f"{name}-*"):  # the same checkpoint under older keys
        if stale != target and stale.name.removeprefix(f"{name}-").isalnum():
            shutil.rmtree(stale, ignore_errors=True)
    return target


def hf_reference(
    model_dir: Path, prompts: list[list[int]], max_tokens: int, quantize_activations: bool = False
) -> tuple[list[list[int]], torch.Tensor]:
    """HF transformers on `model_dir` (decompressed by compressed-tensors): greedy tokens per prompt, EOS
    not stopping, and the first step's logits [prompts, vocab]. Activations stay in float unless asked.
    Kept beside the checkpoint (tests/quant_tools/hf_reference.py writes it)."""

    def build(out: Path) -> None:
        out.mkdir()
        (out / "prompts.json").write_text(json.dumps(prompts))
        args = ["--model", model_dir, "--prompts", out / "prompts.json", "--max-tokens", max_tokens, "--out", out]
        args += ["--quantize-activations"] if quantize_activations else []
        run_tool("llmcompressor", "hf_reference.py", *args, cwd=out.parent)

    key = _key([prompts, max_tokens, quantize_activations], TOOLS / "hf_reference.py")
    answer = cached(model_dir / f"hf-reference-{key}", build)
    tokens = json.loads((answer / "tokens.json").read_text())
    return tokens, load_file(str(answer / "logits.safetensors"))["logits"]


def ct_decompressed(model_dir: Path, modules: list[str]) -> dict[str, torch.Tensor]:
    """compressed-tensors' own decompression of these modules' weights (checkpoint names)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "weights.safetensors"
        args = ["--model", model_dir, "--modules", ",".join(modules), "--out", out]
        run_tool("llmcompressor", "ct_decompress.py", *args, cwd=Path(tmp))
        return load_file(str(out))
