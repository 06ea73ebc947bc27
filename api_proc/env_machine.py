"""`pagoda env`'s view of the machine: operating system, CPU, C compiler and GPUs.

Each function returns one section of the report, a dict of short strings (a nested dict for a list of
like things, such as the instruction sets). A probe that fails reports "unknown (<reason>)" instead of
raising: the report is for bug reports, which are most needed where something is broken.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The CPU features the kernels' speed depends on, as the report names them and as /proc/cpuinfo's flags
# line spells them (Linux; the C kernels are built with -march=native, so these decide their code paths).
INSTRUCTION_SETS = {
    "AVX2": "avx2",
    "FMA": "fma",
    "F16C": "f16c",
    "AVX-512F": "avx512f",
    "AVX-512BW": "avx512bw",
    "AVX-512VL": "avx512vl",
    "AVX-512 VNNI": "avx512_vnni",
    "AVX-VNNI": "avx_vnni",
    "AVX-512 BF16": "avx512_bf16",
    "AMX-TILE": "amx_tile",
    "AMX-BF16": "amx_bf16",
    "AMX-INT8": "amx_int8",
}
_CPUINFO = Path("/proc/cpuinfo")
_OS_RELEASE = Path("/etc/os-release")


def unknown(exc: BaseException) -> str:
    return f"unknown ({type(exc).__name__}: {exc})"


def probe(function: Callable[[], Any]) -> Any:
    """`function()`, or "unknown (<reason>)" if it raises."""
    try:
        return function()
    except Exception as exc:  # noqa: BLE001 - a report that crashes reports nothing
        return unknown(exc)


def system_section() -> dict[str, str]:
    return {
        "platform": probe(platform.platform),
        "kernel": probe(lambda: f"{platform.system()} {platform.release()} {platform.version()}"),
        "distribution": probe(_distribution),
        "python": probe(lambda: sys.version.replace("\n", " ")),
        "python_executable": sys.executable or "unknown (sys.executable is empty)",
    }


def _distribution() -> str:
    if not _OS_RELEASE.exists():
        return "unknown (no /etc/os-release)"
    fields = dict(
        line.split("=", 1) for line in _OS_RELEASE.read_text().splitlines() if "=" in line and not line.startswith("#")
    )
    return fields.get("PRETTY_NAME", fields.get("NAME", "unknown (no name in /etc/os-release)")).strip().strip('"')


def _cpuinfo_entries() -> list[dict[str, str]]:
    """/proc/cpuinfo as one dict per logical CPU (Linux only)."""
    entries: list[dict[str, str]] = [{}]
    for line in _CPUINFO.read_text().splitlines():
        if not line.strip():
            entries.append({})
        elif ":" in line:
            key, value = line.split(":", 1)
            entries[-1][key.strip()] = value.strip()
    return [entry for entry in entries if entry]


def cpu_section() -> dict[str, Any]:
    if not _CPUINFO.exists():
        reason = f"unknown (no /proc/cpuinfo on {platform.system() or 'this system'})"
        return {
            "model": platform.processor() or reason,
            "logical_cpus": str(os.cpu_count() or "unknown"),
            "instruction_sets": reason,
        }
    try:
        entries = _cpuinfo_entries()
    except OSError as exc:
        return {"model": unknown(exc)}
    first = entries[0] if entries else {}
    flags = set(first.get("flags", first.get("Features", "")).split())  # (x86 names the line flags, Arm Features)
    return {
        "model": first.get("model name")
        or first.get("Model")
        or platform.processor()
        or "unknown (not in /proc/cpuinfo)",
        "physical_cores": probe(lambda: _physical_cores(entries)),
        "logical_cpus": str(len(entries)),
        "usable_by_this_process": probe(lambda: str(len(os.sched_getaffinity(0)))),
        "instruction_sets": {name: "yes" if flag in flags else "no" for name, flag in INSTRUCTION_SETS.items()}
        if platform.machine().lower() in ("x86_64", "amd64")
        else f"not x86 ({platform.machine()}: {' '.join(sorted(flags)) or 'no flags listed'})",
    }


def _physical_cores(entries: list[dict[str, str]]) -> str:
    cores = {(entry.get("physical id"), entry.get("core id")) for entry in entries}
    if (None, None) in cores:
        return "unknown (no core ids in /proc/cpuinfo)"
    return str(len(cores))


def compiler_section() -> dict[str, str]:
    from pagoda.kernels.cpu.loader import compiler as kernels_compiler  # (imports torch: only when asked)

    compiler = kernels_compiler()
    if compiler is None:
        return {"path": "not found (no CC, cc or gcc): the C kernels cannot be built"}
    return {
        "path": f"{compiler} (from CC)" if os.environ.get("CC") else compiler,
        "version": probe(lambda: _first_line_of([compiler, "--version"])),
    }


def _first_line_of(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return f"not found ({command[0]})"
    lines = (done.stdout or done.stderr).splitlines()
    if done.returncode != 0:
        return f"unknown ({' '.join(command)} exited with {done.returncode})"
    return lines[0].strip() if lines else f"unknown ({' '.join(command)} printed nothing)"


def gpu_section() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return {"gpus": "none (this torch is built without CUDA)"}
        return {"gpus": "none (torch sees no CUDA device)"}
    section: dict[str, Any] = {
        "cuda_runtime": _runtime(torch),
        "driver": probe(_driver_version),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "(not set)"),
        "gpus": {
            str(index): probe(lambda index=index: _describe_gpu(index)) for index in range(torch.cuda.device_count())
        },
    }
    return section


def _runtime(torch) -> str:
    if torch.version.cuda:
        return f"CUDA {torch.version.cuda}"
    hip = getattr(torch.version, "hip", None)
    return f"ROCm {hip}" if hip else "unknown (torch names neither a CUDA nor a ROCm version)"


def _describe_gpu(index: int) -> str:
    import torch

    props = torch.cuda.get_device_properties(index)
    return f"{props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability {props.major}.{props.minor}"


def _driver_version() -> str:
    """The NVIDIA driver's version: from the kernel module's own file (Linux), else from nvidia-smi."""
    module = Path("/proc/driver/nvidia/version")
    if module.exists():
        return module.read_text().splitlines()[0].strip()  # ("NVRM version: NVIDIA UNIX ... Kernel Module  X ...")
    if shutil.which("nvidia-smi") is None:
        return "unknown (no /proc/driver/nvidia/version, no nvidia-smi)"
    return _first_line_of(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
