"""A real browser for the web app's tests: Playwright driving Debian's Chromium (`/usr/bin/chromium`;
Playwright's own browser download needs the internet, Debian's package needs only the package
registry). The set-up installs it with apt-get when it is missing and the machine allows it (root with
apt, as on CI). Nothing here skips: a browser that cannot be installed or started is an error, so a
machine that cannot run these tests shows as failing rather than as passing. `make serve` never needs
any of this.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")


def ensure_chromium() -> Path:
    """The Chromium binary, installed first if it is missing and this process may (root, apt-get)."""
    if CHROMIUM.exists():
        return CHROMIUM
    apt = shutil.which("apt-get")
    if os.geteuid() != 0 or apt is None:
        raise RuntimeError(
            f"{CHROMIUM} is missing and this machine cannot install it here (needs root and apt-get): "
            "run `apt-get install chromium` first"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = [apt, "install", "-y", "--no-install-recommends", "chromium"]
    result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:  # the package lists may be missing or stale: refresh them once
        subprocess.run([apt, "update"], env=env, capture_output=True, timeout=600)
        result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0 or not CHROMIUM.exists():
        raise RuntimeError(f"`apt-get install chromium` failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return CHROMIUM


def launch(playwright):
    """Headless Chromium (as root, Chromium's sandbox cannot start: it runs without it)."""
    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    return playwright.chromium.launch(executable_path=str(ensure_chromium()), args=args)


def wait_for(condition, timeout: float = 60.0, what: str = "a condition"):
    """Poll `condition()` (from Python: the page's CSP forbids Playwright's in-page eval polling) until
    it returns something true; that value. AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last value: {value!r})")
        time.sleep(0.1)
