"""Serving an ASGI app on loopback in a thread, and looking at it with headless Chromium (Debian's `chromium`).

Chromium runs with a throwaway profile and its background networking off, so it reaches nothing but the page.
Where no Chromium is installed the browser checks skip, except under CI (``CI`` set), where they fail: `.ci/run`
installs it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pettingflow.processes import free_port

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
QUIET = [
    "--headless",
    "--no-sandbox",  # tests often run as root, where Chromium's own sandbox refuses to start
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--hide-scrollbars",
]


def chromium_or_skip() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    message = "no headless Chromium (apt-get install chromium)"
    if os.environ.get("CI"):
        pytest.fail(f"{message}: .ci/run installs it, so CI must have it")
    pytest.skip(message)


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port until the block ends; yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the viewer did not start within 30 s")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _run(browser: str, args: list[str], profile: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [browser, *QUIET, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def dom(browser: str, url: str, profile: Path) -> str:
    """The page's DOM after its scripts ran (``--dump-dom``)."""
    done = _run(browser, ["--dump-dom", url], profile)
    assert done.returncode == 0 and "<html" in done.stdout, f"chromium --dump-dom {url} failed: {done.stderr[-2000:]}"
    return done.stdout


def screenshot(browser: str, url: str, path: Path, profile: Path, size: str = "1280,1600") -> Path:
    done = _run(browser, [f"--screenshot={path}", f"--window-size={size}", url], profile)
    assert done.returncode == 0 and path.is_file(), f"chromium --screenshot {url} failed: {done.stderr[-2000:]}"
    return path
