"""Hugging Face's `kernels` package has this package's import name (transformers >= 5.25 requires it):
installed beside Pagoda, importing `kernels` says so and how to fix it, instead of transformers failing
later on a name our package lacks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def import_kernels(extra_path: Path | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", "import kernels"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_hugging_faces_kernels_installed_beside_pagoda_is_refused_with_the_fix(tmp_path):
    assert import_kernels(None).returncode == 0, "the project's own environment must not hold HF's kernels"
    metadata = tmp_path / "kernels-0.19.1.dist-info"  # what `pip install kernels` leaves in site-packages
    metadata.mkdir()
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n")
    result = import_kernels(tmp_path)
    assert result.returncode != 0
    assert "Hugging Face's `kernels` package (0.19.1) is installed beside Pagoda" in result.stderr
    assert "pip uninstall kernels" in result.stderr
