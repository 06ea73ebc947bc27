"""No C compiler on the machine: the C kernels cannot be built, and the engine runs on the torch reference
kernels instead, saying so once (why, and how to fix it) rather than failing or repeating itself per
library or per call.

The compiler is `$CC`, else `cc` or `gcc` on PATH (kernels/cpu's loader): each case takes one of those
away, in a `pagoda generate` subprocess whose kernel build dir ($PAGODA_CACHE/kernels) starts empty, so no
library built earlier can be loaded instead."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROMPT = "What is the capital of France?"
NOTICE = "C kernels unavailable"


def _generate(env: dict[str, str], model_dir, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagoda.api_proc.cli", "generate", "--chat", "--model", str(model_dir), PROMPT],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=cwd,
    )


@pytest.mark.parametrize("how", ["nothing on PATH", "CC names a missing compiler"])
def test_generate_runs_on_the_torch_reference_and_says_why_once(how, default_model_dir, tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "CC"}
    env["PAGODA_CACHE"] = str(tmp_path / "cache")  # an empty kernel build dir (the model comes from --model)
    env.pop("PAGODA_DISABLE_CPU_KERNELS", None)
    if how == "nothing on PATH":
        (tmp_path / "bin").mkdir()
        env["PATH"] = str(tmp_path / "bin")  # (python runs by its full path: sys.executable)
    else:
        env["CC"] = str(tmp_path / "no-such-compiler")

    run = _generate(env, default_model_dir, tmp_path)

    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout, run.stdout  # the 135M model's answer, on the torch reference kernels
    notices = [line for line in run.stderr.splitlines() if NOTICE in line]
    assert len(notices) == 1, run.stderr
    notice = notices[0]
    # Why, and the two ways to fix it.
    if how == "nothing on PATH":
        assert "no C compiler found" in notice, notice
    else:
        assert str(tmp_path / "no-such-compiler") in notice, notice
    assert "build-essential" in notice and "CC" in notice, notice
    assert not list((tmp_path / "cache").rglob("*.so")), "nothing was built"
