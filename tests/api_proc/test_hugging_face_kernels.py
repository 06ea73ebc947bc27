"""Hugging Face's `kernels` package installed beside Pagoda (transformers >= 5.25 depends on it, so
`make install` puts it in .venv): both import in one process, and a server answers.

Our kernels/ folder has no __init__.py (it imports as `pagoda.kernels`, pyproject.toml), so even with this
checkout on sys.path, as it is under pytest and for `python -m` run from here, `import kernels` gets Hugging
Face's package and never ours."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BOTH = """
import json, kernels, pagoda.kernels.ops as ops
from transformers.integrations import hub_kernels
from transformers.utils import is_kernels_available
print(json.dumps({"kernels": kernels.__file__, "ops": ops.__file__, "available": is_kernels_available(),
                  "get_kernel": hasattr(kernels, "get_kernel")}))
"""


def test_hugging_faces_kernels_is_installed_beside_pagoda():
    assert importlib.metadata.distribution("kernels").version, "transformers >= 5.25 brings Hugging Face's kernels"


def test_both_import_in_one_process_from_the_checkout_root():
    # cwd = the checkout: `python -c` puts it first on sys.path, beside our kernels/ folder.
    run = subprocess.run([sys.executable, "-c", BOTH], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["kernels"] is not None and "site-packages" in found["kernels"] and found["get_kernel"], found
    assert found["available"], "transformers sees Hugging Face's kernels"
    assert Path(found["ops"]).resolve() == ROOT / "kernels" / "ops.py"


def test_a_server_answers_with_both_installed(client):
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    assert reply.choices[0].message.content.strip()
