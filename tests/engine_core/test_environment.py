"""Every PAGODA_* variable is read in engine_core/environment.py only, and docs/command-line.md lists each one."""

from __future__ import annotations

import ast
from pathlib import Path

from pagoda.engine_core.environment import VARIABLES

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api_proc", "detok_proc", "engine_core", "kernels", "benchmarks")


def _reads_of_the_environment(path: Path) -> list[str]:
    """`os.environ.get("PAGODA_...")`, `os.environ["PAGODA_..."]` and `os.getenv("PAGODA_...")` in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv"):
            arguments = node.args
        elif (
            isinstance(node, ast.Subscript)
            and ast.unparse(node.value) == "os.environ"
            and isinstance(node.ctx, ast.Load)
        ):
            arguments = [node.slice]
        else:
            continue
        found += [a.value for a in arguments[:1] if isinstance(a, ast.Constant) and str(a.value).startswith("PAGODA_")]
    return found


def test_only_the_environment_module_reads_pagoda_variables():
    readers = {
        str(path.relative_to(ROOT)): names
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if (names := _reads_of_the_environment(path))
    }
    assert readers == {}, readers
    assert _reads_of_the_environment(ROOT / "engine_core" / "environment.py") == []  # through _get, by name


def test_the_command_line_guide_lists_every_variable():
    guide = (ROOT / "docs" / "command-line.md").read_text()
    missing = [name for name in VARIABLES if f"`{name}`" not in guide]
    assert missing == []
