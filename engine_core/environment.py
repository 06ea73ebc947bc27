"""Every `PAGODA_*` environment variable, read here and nowhere else (docs/command-line.md lists them; a
test keeps the two in step).

Modules that need one of these settings ask this module; `kernels` reads no environment at all and
is configured by the engine (`configure_kernels`), so it stays a library with no view of the process.
"""

from __future__ import annotations

import os
from pathlib import Path

VARIABLES = {
    "PAGODA_CACHE": "directory of the converted default model and the compiled CPU kernels (default ~/.cache/pagoda)",
    "PAGODA_API_KEY": "API keys, comma-separated (added to --api-key)",
    "PAGODA_ADMIN_KEY": "admin keys, comma-separated (added to --admin-key)",
    "PAGODA_ROUTER_API_KEY": "keys clients must send `pagoda router`, comma-separated (added to its --api-key)",
    "PAGODA_LOG_LEVEL": "log level of every process (set by --log-level; children inherit it)",
    "PAGODA_LOG_FORMAT": "text or json (set by --log-format; children inherit it)",
    "PAGODA_DISABLE_CPU_KERNELS": "1 = the plain torch kernels on the CPU instead of the compiled C ones",
    "PAGODA_DISABLE_TRITON": "1 = the plain torch kernels on CUDA instead of Triton (the GPU check's reference)",
    "PAGODA_DISABLE_ONEDNN_LINEAR": "1 = plain F.linear on the CPU instead of oneDNN's packed weights",
    "PAGODA_DISABLE_PANEL_LINEAR": "1 = oneDNN's packed weights for CPU float32 linears, not the C panel matmul",
    "PAGODA_DISABLE_FUSED_DECODE": "1 = CPU decode steps run layer by layer in torch, not as one C call per step",
    "PAGODA_DISABLE_AMX": "1 = long prompts' float32 projections on the CPU's vector units, not Intel AMX",
    "PAGODA_DISABLE_INT8_ACTIVATIONS": "1 = as --no-int8-activations, for every engine of the process and its children",
}


def _get(name: str, default: str = "") -> str:
    assert name in VARIABLES, f"{name} is not a documented PAGODA_* variable"
    return os.environ.get(name, default)


def _flag(name: str) -> bool:
    return _get(name) == "1"


def cache_root() -> Path:
    return Path(_get("PAGODA_CACHE") or Path.home() / ".cache" / "pagoda")


def keys_from_environment(name: str) -> list[str]:
    """PAGODA_API_KEY / PAGODA_ADMIN_KEY, split at commas."""
    return [key for key in _get(name).split(",") if key.strip()]


def log_settings() -> tuple[str, str]:
    """(level, format) this process should log with, as its parent set them."""
    return _get("PAGODA_LOG_LEVEL", "INFO"), _get("PAGODA_LOG_FORMAT", "text")


def export_log_settings(level: str, log_format: str) -> None:
    """Hand the log settings down to every child process started from now on."""
    os.environ["PAGODA_LOG_LEVEL"], os.environ["PAGODA_LOG_FORMAT"] = level.upper(), log_format


def onednn_linear_disabled() -> bool:
    return _flag("PAGODA_DISABLE_ONEDNN_LINEAR")


def panel_linear_disabled() -> bool:
    return _flag("PAGODA_DISABLE_PANEL_LINEAR")


def fused_decode_disabled() -> bool:
    return _flag("PAGODA_DISABLE_FUSED_DECODE")


def configure_kernels(int8_activations: bool = False) -> None:
    """Tell the kernels which implementations this process may use and where they build C kernels."""
    from pagoda.kernels import ops

    ops.configure(
        cpu_kernels=not _flag("PAGODA_DISABLE_CPU_KERNELS"),
        triton=not _flag("PAGODA_DISABLE_TRITON"),
        build_dir=cache_root() / "kernels",
        int8_activations=int8_activations and not _flag("PAGODA_DISABLE_INT8_ACTIVATIONS"),
        amx=not _flag("PAGODA_DISABLE_AMX"),
    )


def pagoda_environment() -> dict[str, str]:
    """Every PAGODA_* variable set in this process: what a process started elsewhere (a Ray actor) must
    be given to behave as this one's children do."""
    return {name: os.environ[name] for name in VARIABLES if name in os.environ}


def prefer_passive_thread_waits() -> None:
    """Have OpenMP threads sleep, not spin, when they wait (`OMP_WAIT_POLICY=PASSIVE`, unless set): read
    when torch loads, so call it first. A pooling engine's steps are long and end in a wait for the next
    requests, while the tokenizer and HTTP processes need the same cores to bring them: spinning threads
    took that time from them. benchmarks/embeddings.py on the 2-core machine: 71 sentences/s passive, 37
    spinning, in the same run (docs/embeddings.md)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
