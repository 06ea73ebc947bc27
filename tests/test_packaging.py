"""How the code is packaged (pyproject.toml's [tool.setuptools]): fast checks of the checkout itself. The wheel
built from it, installed and run in a fresh venv, is tests/test_wheel.py.

setuptools installs only the packages its `packages` list names: a new subpackage folder missing from the
list works in the checkout (the editable install maps whole folders) and is silently left out of the wheel.
And kernels/ must stay a namespace portion (no __init__.py): as a regular package on sys.path (the checkout
root is, under pytest and for `python -m` run from here) it would shadow Hugging Face's `kernels`, which
transformers imports."""

from __future__ import annotations

from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
CODE_FOLDERS = ("api_proc", "detok_proc", "engine_core", "kernels")


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_folders() -> set[str]:
    """pagoda.<folder>[.<sub>...] for the four code folders and every folder under them with an __init__.py."""
    names = {f"pagoda.{folder}" for folder in CODE_FOLDERS}
    for folder in CODE_FOLDERS:
        for init in (ROOT / folder).rglob("__init__.py"):
            if init.parent != ROOT / folder:
                names.add("pagoda." + ".".join(init.parent.relative_to(ROOT).parts))
    return names


def test_each_code_folder_is_mapped_to_its_import_name():
    assert _setuptools()["package-dir"] == {f"pagoda.{folder}": folder for folder in CODE_FOLDERS}


def test_the_packages_list_names_exactly_the_package_folders():
    listed = _setuptools()["packages"]
    assert len(listed) == len(set(listed)), "a package listed twice"
    found = _package_folders()
    missing, extra = sorted(found - set(listed)), sorted(set(listed) - found)
    assert not missing, f"package folders left out of the wheel (add them to pyproject.toml's packages): {missing}"
    assert not extra, f"listed in pyproject.toml's packages, but no such package folder: {extra}"


def test_every_folder_of_python_code_is_a_package():
    # A folder of .py files without an __init__.py would be a namespace package: importable from the checkout,
    # absent from the wheel, and not caught by the list check above. kernels/ itself is the one exception.
    for folder in CODE_FOLDERS:
        for source in (ROOT / folder).rglob("*.py"):
            where = source.parent
            if where != ROOT / "kernels":
                assert (where / "__init__.py").exists(), f"{where.relative_to(ROOT)} has Python code but no __init__.py"


def test_kernels_is_a_namespace_portion():
    assert not (ROOT / "kernels" / "__init__.py").exists(), "kernels/__init__.py would shadow Hugging Face's kernels"
