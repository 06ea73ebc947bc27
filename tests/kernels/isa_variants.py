"""The C kernels built for the other instruction sets this machine can run, beside the one
-march=native picks: AVX2 (with and without VNNI) where the machine has AVX-512, and the scalar code
everywhere. CI's machines may have another ISA than the one the suite runs on; this covers every path."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from pagoda.kernels.cpu import loader


def _cpu_flags() -> set[str]:
    if not Path("/proc/cpuinfo").exists():
        return set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def variants() -> list[tuple[str, list[str]]]:
    """(name, the compiler flags turning the other extensions off) for each ISA besides native."""
    flags = _cpu_flags()
    found = [("scalar", ["-mno-avx512f", "-mno-avxvnni", "-mno-avx2", "-mno-fma", "-mno-avx"])]
    if "avx512f" in flags and {"avx2", "fma"} <= flags:
        found.append(("avx2", ["-mno-avx512f", "-mno-avxvnni"]))
        if "avx_vnni" in flags:
            found.append(("avx-vnni", ["-mno-avx512f"]))
    return found


def build(library: str, directory: Path, extra: list[str]) -> dict:
    """kernels/cpu/<library>.c built with `extra` flags: its C functions by name, as `loader.load` has them."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    target = directory / f"{library}.so"
    source = Path(loader.__file__).parent / f"{library}.c"
    flags = [*loader._COMMON_FLAGS, *loader._LIBRARIES[library], *extra]
    subprocess.run([compiler, *flags, str(source), "-o", str(target), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(target))
    functions = {}
    for symbol, argtypes in loader._SIGNATURES.items():
        if hasattr(lib, symbol):
            fn = getattr(lib, symbol)
            fn.argtypes, fn.restype = argtypes, loader._RESULTS.get(symbol)
            functions[symbol] = fn
    return functions


def build_all(library: str, tmp_path_factory) -> dict[str, dict]:
    """`build` for every variant: {variant name: its C functions by name} (a module fixture's value)."""
    return {name: build(library, tmp_path_factory.mktemp(name), extra) for name, extra in variants()}
