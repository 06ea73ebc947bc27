"""`pagoda env`: what a bug report needs to know about this installation and machine, in the spirit of
vLLM's `collect_env`: Pagoda's version and where it is installed, the OS, Python, CPU, C compiler, the
libraries Pagoda runs on, the GPUs, and which kernel the engine picks for each op here.

`gather()` returns the report as sections of "key: value" (nested one level for lists of like things);
`render_text` lays it out for people, `pagoda env --json` prints it as JSON for tools. Nothing here may
raise: a section or probe that fails reads "unknown (<reason>)".
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagoda.api_proc.env_kernels import kernels_section
from pagoda.api_proc.env_machine import compiler_section, cpu_section, gpu_section, probe, system_section, unknown

DISTRIBUTION = "pagoda-llm"
# (report name, distribution name): the libraries whose versions decide what Pagoda does. `hf_kernels` is
# Hugging Face's kernel hub package (`kernels`), not ours.
LIBRARIES = [
    ("torch", "torch"),
    ("triton", "triton"),
    ("transformers", "transformers"),
    ("tokenizers", "tokenizers"),
    ("xgrammar", "xgrammar"),
    ("numpy", "numpy"),
    ("hf_kernels", "kernels"),
]


def pagoda_version() -> str:
    """The installed distribution's version (pyproject.toml's, as of the last install)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown (the pagoda-llm distribution is not installed)"


def gather() -> dict[str, dict[str, Any]]:
    sections: dict[str, Callable[[], dict[str, Any]]] = {
        "pagoda": pagoda_section,
        "system": system_section,
        "cpu": cpu_section,
        "compiler": compiler_section,
        "libraries": libraries_section,
        "gpu": gpu_section,
        "kernels": kernels_section,
    }
    report = {}
    for name, section in sections.items():
        try:
            report[name] = section()
        except Exception as exc:  # noqa: BLE001 - the rest of the report is still worth having
            report[name] = {"error": unknown(exc)}
    return report


def pagoda_section() -> dict[str, str]:
    return {"version": pagoda_version(), "installed": probe(_installation)}


def _installation() -> str:
    """Where `pagoda` is imported from: a checkout (an editable install, with its commit) or site-packages."""
    spec = importlib.util.find_spec("pagoda.api_proc")
    if spec is None or spec.origin is None:
        return "unknown (pagoda.api_proc has no file)"
    package_dir = Path(spec.origin).parent
    if {"site-packages", "dist-packages"} & set(package_dir.parts):
        return str(package_dir.parent)
    checkout = package_dir.parent  # (the editable install maps pagoda.api_proc onto <checkout>/api_proc)
    return f"checkout {checkout}{_git_commit(checkout)}"


def _git_commit(checkout: Path) -> str:
    try:
        head = subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        status = subprocess.run(
            ["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    if head.returncode != 0:
        return ""
    return f" (commit {head.stdout.strip()}{', with local changes' if status.stdout.strip() else ''})"


def libraries_section() -> dict[str, str]:
    section = {name: _installed_version(distribution) for name, distribution in LIBRARIES}
    section["torch_build"] = probe(_torch_build)
    return section


def _installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _torch_build() -> str:
    import torch

    if torch.version.cuda:
        accelerator = f"CUDA {torch.version.cuda}"
    elif getattr(torch.version, "hip", None):
        accelerator = f"ROCm {torch.version.hip}"
    else:
        accelerator = "CPU only"
    mkldnn = "available" if torch.backends.mkldnn.is_available() else "not available"
    return f"{accelerator}, MKL-DNN (oneDNN) {mkldnn}, {torch.get_num_threads()} threads"


_TITLES = {
    "pagoda": "Pagoda",
    "system": "System",
    "cpu": "CPU",
    "compiler": "Compiler",
    "libraries": "Libraries",
    "gpu": "GPU",
    "kernels": "Kernels",
}


def render_text(report: dict[str, dict[str, Any]]) -> str:
    """The report as sections of aligned "key: value" lines, a nested dict as an indented block."""
    lines: list[str] = []
    for title, section in report.items():
        lines.append(_TITLES.get(title, title))
        _render_block(section, "  ", lines)
        lines.append("")
    return "\n".join(lines).rstrip()


def _render_block(block: dict[str, Any], indent: str, lines: list[str], nested: bool = False) -> None:
    """A section's keys read as words ("python executable"); a nested block's are names (ops, instruction
    sets, GPU indices) and stay as they are."""
    labels = {key: key if nested else key.replace("_", " ") for key in block}
    width = max((len(label) for label in labels.values()), default=0)
    for key, value in block.items():
        if isinstance(value, dict):
            lines.append(f"{indent}{labels[key]}:")
            _render_block(value, indent + "  ", lines, nested=True)
        else:
            lines.append(f"{indent}{labels[key] + ':':<{width + 1}} {value}")
