"""`pagoda --version` and `pagoda env` (api_proc/env_report.py), run as the real command line."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from pagoda.api_proc import env_kernels, env_machine
from pagoda.kernels import cpu, ops


def run_cli(*args: str, **environment: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagoda.api_proc.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,  # (the first run on a machine builds the C kernels)
        env={**os.environ, **environment},
    )


def cpu_model() -> str | None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return None
    return next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")),
        None,
    )


def expected_cpu_pick() -> str:
    """What rms_norm runs on the CPU: the C kernel where it builds here (this process is configured as the
    engine is, tests/conftest.py), else the torch reference."""
    return "C" if cpu.available() else "torch reference"


def test_version_prints_the_installed_distributions_version():
    # (asked of a process started the same way as the CLI, so both see the same metadata on sys.path)
    version = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as m; print(m.version('pagoda-llm'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    for flag in ("--version", "-V"):
        done = run_cli(flag)
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"pagoda {version}\n"


def test_env_names_the_cpu_libraries_and_kernel_picks():
    done = run_cli("env")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    for section in ("Pagoda", "System", "CPU", "Compiler", "Libraries", "GPU", "Kernels"):
        assert re.search(rf"^{section}$", text, re.MULTILINE), section
    model = cpu_model()
    if model is not None:
        assert re.search(rf"^  model:\s+{re.escape(model)}$", text, re.MULTILINE)
    for library in ("torch", "transformers"):
        version = importlib.metadata.version(library)
        assert re.search(rf"^  {library}:\s+{re.escape(version)}$", text, re.MULTILINE), library
    assert re.search(rf"^    rms_norm:\s+{expected_cpu_pick()} \(", text, re.MULTILINE)


def test_env_json_has_the_same_fields():
    done = run_cli("env", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["pagoda"]["version"] == importlib.metadata.version("pagoda-llm")
    if (model := cpu_model()) is not None:
        assert report["cpu"]["model"] == model
    assert report["libraries"]["torch"] == importlib.metadata.version("torch")
    assert report["libraries"]["transformers"] == importlib.metadata.version("transformers")
    cpu_ops = report["kernels"]["cpu_ops"]
    assert set(cpu_ops) == set(ops.op_names())
    assert cpu_ops["rms_norm"].startswith(f"{expected_cpu_pick()} (")


def test_env_with_cpu_kernels_disabled_reports_the_torch_reference():
    done = run_cli("env", "--json", PAGODA_DISABLE_CPU_KERNELS="1")
    assert done.returncode == 0, done.stderr
    kernels = json.loads(done.stdout)["kernels"]
    assert all(pick.startswith("torch reference (") for pick in kernels["cpu_ops"].values()), kernels["cpu_ops"]
    assert "PAGODA_DISABLE_CPU_KERNELS=1" in kernels["disabled_by_environment"]


def test_env_without_a_compiler_still_reports(tmp_path):
    """No C compiler (CC names none, and a fresh cache holds no kernels built earlier): the report says why
    the C kernels are missing instead of failing."""
    done = run_cli("env", "--json", CC=str(tmp_path / "no-such-cc"), PAGODA_CACHE=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["kernels"]["c_kernels"].startswith("not available: ")
    assert "no-such-cc" in report["kernels"]["c_kernels"]
    assert report["kernels"]["cpu_ops"]["rms_norm"].startswith("torch reference (")
    assert report["compiler"]["version"].startswith("not found")


def test_gpu_sections_on_a_cuda_machine(monkeypatch):
    """What a CUDA machine's report holds, with torch told it has one GPU (the suite runs where there is
    none): each op's CUDA pick named by kind."""
    fake = types.SimpleNamespace(name="Fake GPU", total_memory=80 * 2**30, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: fake)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    gpu = env_machine.gpu_section()
    assert gpu["cuda_runtime"] == "CUDA 12.8"
    assert gpu["gpus"] == {"0": "Fake GPU, 80.0 GiB, compute capability 9.0"}
    cuda_ops = env_kernels.kernels_section()["cuda_ops"]
    assert cuda_ops["rms_norm"].startswith("Triton (pagoda.kernels.triton.")
    assert cuda_ops["fp8_linear"].startswith("torch (CUDA native) (")
    assert cuda_ops["panel_linear"].startswith("torch reference (")  # (CPU-only: no Triton kernel)


@pytest.mark.parametrize("failing", ["cpu_section", "gpu_section"])
def test_a_failing_section_is_reported_not_raised(monkeypatch, failing):
    from pagoda.api_proc import env_report

    def broken():
        raise OSError("probe broke")

    monkeypatch.setattr(env_report, failing, broken)
    report = env_report.gather()
    name = failing.removesuffix("_section")
    assert report[name] == {"error": "unknown (OSError: probe broke)"}
    assert "unknown (OSError: probe broke)" in env_report.render_text(report)
