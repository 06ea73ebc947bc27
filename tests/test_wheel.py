"""The wheel, built and used as a user would: `python -m build` on a copy of the checkout (an sdist, then the
wheel from that sdist, so the sdist is checked to rebuild it), installed with pip into a fresh venv that sees
nothing of this one, and run from outside the checkout: `pagoda download-default`, `pagoda generate` (the C
kernels compiling from the wheel's own sources into an empty build dir), `pagoda serve` answering one chat
completion and stopping cleanly, and Hugging Face's `kernels` importing beside ours.

Slow: 4.5 minutes (267 s) on a 2-core AMD EPYC with AVX2, 2026-12-07, with other work sharing the cores: the
build 9 s, the venv with torch's CPU wheel and the wheel's dependencies from the package registry 117 s, and
141 s of running (the default model's download and conversion, compiling the C kernels, the generation, the
server's start and stop). pip's cache is the user's own, so a warm one makes the install faster.
docs/testing.md lists it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagoda.api_proc.bench.local_server import alive, child_pids, free_port, http, wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CODE_FOLDERS = ("api_proc", "detok_proc", "engine_core", "kernels")
PROMPT = "What is the capital of France?"


def _torch_pin() -> str:
    """The torch the Makefile installs (the CPU wheel): installed first, so the wheel's `torch>=2.4` is met
    without pip choosing a CUDA build."""
    return re.search(r"^TORCH\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1)


def _run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert run.returncode == 0, f"{cmd} exited with {run.returncode}:\n{run.stdout}\n{run.stderr}"
    return run


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The sdist and the wheel built from a copy of the checkout's files (tracked, and new ones not ignored):
    nothing is built inside the checkout, and nothing it ignores (.venv, build/) reaches the build."""
    work = tmp_path_factory.mktemp("wheel-build")
    listed = _run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], timeout=60, cwd=ROOT
    ).stdout.split("\0")
    source = work / "source"
    for name in filter(None, listed):
        if (ROOT / name).is_file():  # (a tracked file deleted in the working tree is left out)
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    # No flags: build makes the sdist, then the wheel from the unpacked sdist, each in an isolated environment
    # whose setuptools pip fetches from the registry.
    _run([sys.executable, "-m", "build", "--outdir", str(work / "dist"), str(source)], timeout=600, cwd=work)
    return work / "dist"


def _wheel(dist: Path) -> Path:
    (wheel,) = dist.glob("*.whl")
    return wheel


def test_the_wheel_holds_every_file_of_the_code_folders(dist):
    (sdist,) = dist.glob("*.tar.gz")
    names = set(zipfile.ZipFile(_wheel(dist)).namelist())
    # Every module, the C sources and headers the kernels compile from at run time, and the web app's files.
    expected = {f"pagoda/{path.relative_to(ROOT)}" for folder in CODE_FOLDERS for path in _files(ROOT / folder)}
    assert expected - names == set(), f"missing from the wheel: {sorted(expected - names)}"
    assert any(name.startswith("pagoda/kernels/cpu/") and name.endswith(".h") for name in names)
    assert any(name.startswith("pagoda/api_proc/ui/") for name in names)
    assert "pagoda/kernels/__init__.py" not in names  # a namespace portion (tests/test_packaging.py)
    assert {name.split("/")[0] for name in names} == {"pagoda", _wheel(dist).name.split("-py3")[0] + ".dist-info"}
    assert sdist.name.startswith(_wheel(dist).name.split("-py3")[0])


def _files(folder: Path) -> list[Path]:
    """The files git knows of under `folder` (what the build copied), less compiled bytecode."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", str(folder)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout.split()
    return [ROOT / name for name in listed if (ROOT / name).is_file()]


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Iterator[Path]:
    """A new venv (no system site-packages) with the CPU torch, then the wheel and its dependencies; removed
    after the module (about 3 GB, which the rest of the suite's disk needs more)."""
    where = tmp_path_factory.mktemp("wheel-venv") / "venv"
    try:
        _run([sys.executable, "-m", "venv", str(where)], timeout=300)
        assert "include-system-site-packages = false" in (where / "pyvenv.cfg").read_text()
        pip = [str(where / "bin" / "python"), "-m", "pip", "install", "-q"]
        _run([*pip, _torch_pin()], timeout=900)
        _run([*pip, str(_wheel(dist)), _torch_pin()], timeout=900)
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _environment(venv: Path, home: Path) -> dict[str, str]:
    """The venv's commands first on PATH, every cache and runtime directory under `home`, and none of this
    process's Python or Pagoda settings."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PAGODA_", "PYTHON", "VIRTUAL_ENV", "TRITON_", "HF_"))
    }
    # pip's cache stays the user's (download-default runs pip): set before XDG_CACHE_HOME moves it.
    pip_cache = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "cache", "dir"], capture_output=True, text=True, env=env
    ).stdout.strip()
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        PAGODA_CACHE=str(home / "pagoda-cache"),
        XDG_CACHE_HOME=str(home / "xdg-cache"),
        XDG_RUNTIME_DIR=str(home / "run"),
        HF_HOME=str(home / "hf"),
    )
    if pip_cache:
        env["PIP_CACHE_DIR"] = pip_cache
    for directory in ("xdg-cache", "run", "work"):
        (home / directory).mkdir(parents=True, exist_ok=True)
    return env


def test_the_installed_wheel_downloads_generates_and_serves(venv, tmp_path):
    env = _environment(venv, tmp_path)
    work = tmp_path / "work"  # outside the checkout: nothing of it is on sys.path
    pagoda = str(venv / "bin" / "pagoda")
    kernel_dir = tmp_path / "pagoda-cache" / "kernels"
    assert not kernel_dir.exists()

    model = _run([pagoda, "download-default"], timeout=900, cwd=work, env=env).stdout.strip().splitlines()[-1]
    assert Path(model, "config.json").exists()

    generated = _run([pagoda, "generate", "--chat", PROMPT], timeout=900, cwd=work, env=env)
    assert "Paris" in generated.stdout, generated.stdout + generated.stderr  # "The capital of France is Paris."
    assert "unavailable" not in generated.stderr, generated.stderr
    # The C kernels were compiled from the wheel's sources into the empty build dir: one library per source.
    installed_sources = {path.stem for path in venv.glob("lib/python*/site-packages/pagoda/kernels/cpu/*.c")}
    assert installed_sources, "the wheel installed no C sources"
    assert {path.name.rsplit("-", 1)[0] for path in kernel_dir.glob("*.so")} == installed_sources

    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [pagoda, "serve", "--port", str(port), "--kv-cache-memory", "256MiB"],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=work,
            env=env,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            ready = wait_until(lambda: server.poll() is not None or _healthy(base), timeout=300, interval=0.2)
            assert ready and server.poll() is None, log_path.read_text(errors="replace")
            _, models = http("GET", base + "/v1/models")
            status, reply = http(
                "POST",
                base + "/v1/chat/completions",
                {
                    "model": models["data"][0]["id"],
                    "messages": [{"role": "user", "content": PROMPT}],
                    "max_tokens": 16,
                    "temperature": 0,
                },
                timeout=120,
            )
            assert status == 200, reply
            assert "Paris" in reply["choices"][0]["message"]["content"], reply
            children = child_pids(server.pid)
            assert children, "serve runs its engine and detokenizer in child processes"
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=60) == 0, log_path.read_text(errors="replace")
            assert wait_until(lambda: not any(alive(pid) for pid in children), timeout=30), "children left running"
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()

    # Hugging Face's kernels (transformers depends on it) and ours, side by side in the installed venv.
    imports = _run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import kernels, transformers, pagoda.kernels.ops as ops; print(kernels.__file__); print(ops.__file__)",
        ],
        timeout=300,
        cwd=work,
        env=env,
    )
    hugging_face, ours = imports.stdout.split()
    site = next(venv.glob("lib/python*/site-packages"))
    assert Path(hugging_face).is_relative_to(site / "kernels"), hugging_face
    assert Path(ours) == site / "pagoda" / "kernels" / "ops.py", ours


def _healthy(base: str) -> bool:
    try:
        return http("GET", base + "/health", timeout=2)[0] == 200
    except OSError:
        return False
