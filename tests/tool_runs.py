"""The quantization tools the tests make real checkpoints with: their venvs, running their scripts, and keeping
what the scripts write in the model cache. Used by the formats' helpers, tests/quant_checkpoints.py
(compressed-tensors, FP8) and tests/gptq_awq_checkpoints.py (GPTQ, AWQ).

Each tool pins other versions of transformers than Pagoda's (and than the others), so each lives in a venv of
its own beside .venv, built by `make tool-venvs` from tests/quant_tools/<tool>.txt: .venv-llmcompressor
(llmcompressor; HF transformers reading compressed-tensors and FP8), .venv-gptq (GPTQModel; HF transformers
reading GPTQ and AWQ through it), .venv-awq (AutoAWQ). The scripts in tests/quant_tools run with that venv's
python, in a subprocess, offline.

What they write is kept under cache_dir() and made once (tens of minutes on two cores), found by a key: a
fingerprint of what determines it, which each format's helpers choose (compressed-tensors: the scripts and
the pins, so that editing a script makes new outputs; GPTQ/AWQ: the arguments, the pins and a version
bumped by hand).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from pagoda.engine_core.default_model import COMPLETE_MARKER
from pagoda.engine_core.environment import cache_root

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tests" / "quant_tools"
VENVS = {tool: REPO / f".venv-{tool}" for tool in ("llmcompressor", "gptq", "awq")}
VENV_STAMP = ".pagoda-tool-installed"  # the Makefile's TOOL_STAMP: written once a tool venv is complete

# The two ways a cached directory says it is complete (see `cached`).
COMPLETE = COMPLETE_MARKER  # its key is part of its name: complete once this is written, as a downloaded model
KEYED = ".pagoda-checkpoint.json"  # a fixed name: {"key": ...}, made again in place when the key changes


def cache_dir() -> Path:
    """Where the tools' outputs are kept (shared by every format's)."""
    return cache_root() / "test-checkpoints"


def tool_python(tool: str) -> Path:
    """The python of `tool`'s venv; a test needing it fails (never skips) when the venv is not complete."""
    venv = VENVS[tool]
    if not (venv / VENV_STAMP).exists():
        pytest.fail(
            f"the {tool} tool venv {venv} is missing or incomplete: run `make tool-venvs` "
            f"(it installs tests/quant_tools/{tool}.txt there)",
            pytrace=False,
        )
    return venv / "bin" / "python"


def run_tool(tool: str, script: str, *args: object, cwd: Path) -> None:
    """Run tests/quant_tools/`script` with `tool`'s python, in `cwd` (tools write logs there: GPTQModel a logs/
    directory); the test fails with the end of its output if it fails."""
    command = [str(tool_python(tool)), str(TOOLS / script), *map(str, args)]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",  # everything is local; no hub lookups from the tools
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
    }
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)
    if result.returncode != 0:
        tail = (result.stdout + result.stderr)[-4000:]
        pytest.fail(f"{' '.join(command)} exited with {result.returncode}:\n{tail}", pytrace=False)


def fingerprint(*parts: object) -> str:
    """16 hex digits of the SHA-256 of `parts` in order: a file's bytes, anything else as sorted JSON."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.read_bytes() if isinstance(part, Path) else json.dumps(part, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def cached(target: Path, build: Callable[[Path], None], key: str | None = None) -> Path:
    """`target`, made by `build(out)` (which writes the directory `out`) unless it is there complete: with a
    `key`, its KEYED marker records that key (a directory of fixed name, made again when its key changes);
    without, the key is part of `target`'s name and its COMPLETE marker is enough. Built beside its place and
    renamed into it, so that a half-written one is never seen."""
    marker = target / (COMPLETE if key is None else KEYED)
    if marker.exists() and (key is None or json.loads(marker.read_text()).get("key") == key):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".staging-{target.name}-", dir=target.parent))
    try:
        out = staging / "out"
        build(out)
        (out / marker.name).write_text("" if key is None else json.dumps({"key": key}))
        if target.exists():
            shutil.rmtree(target)
        out.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
