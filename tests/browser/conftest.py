"""Fixtures for the browser tests: pytest-playwright's, on Debian's Chromium, and a JupyterLab.

pytest-playwright provides ``browser``, ``context`` and ``page``; this file only tells it which
browser to start and how:

- ``chromium_path``: the Chromium binary, or a skip with the reason when this machine has none
  (``tools/ensure_chromium.sh``, run by ``make test``, installs it on Debian-like systems).
  The tests never download a browser: ``browser_type_launch_args`` hands this binary to
  playwright as ``executable_path``.
- ``browser_context_args``: the viewport of every page.
- ``lab``: one JupyterLab per test session on 127.0.0.1, serving a *copy* of notebooks/ from a
  temporary folder; stopped (sessions, kernels, server) at the end of the session.
- ``page``: pytest-playwright's page, with the lab running; the test's kernels are shut down
  after it.
- ``shots``: the folder the screenshots go to (printed at the end of the run; look at them).

Waiting is Playwright's: locator actions and ``expect`` assertions retry until they hold or
their timeout (30 s here) runs out.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from labdriver import CHROMIUM_ARGS, NOTEBOOKS, LabServer

_SHOTS: list[Path] = []


def find_chromium() -> Path | None:
    """$COURSE_CHROMIUM if set, else Debian's /usr/bin/chromium, else chromium on PATH."""
    explicit = os.environ.get("COURSE_CHROMIUM")
    candidates = [explicit] if explicit else ["/usr/bin/chromium", shutil.which("chromium"),
                                              shutil.which("chromium-browser")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


@pytest.fixture(scope="session")
def chromium_path() -> Path:
    path = find_chromium()
    if path is None:
        pytest.skip("no Chromium on this machine (looked for $COURSE_CHROMIUM, /usr/bin/chromium, "
                    "chromium on PATH); on Debian/Ubuntu run tools/ensure_chromium.sh as root")
    return path


TIMEOUT_MS = 30_000


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args, chromium_path):
    return {**browser_type_launch_args, "executable_path": str(chromium_path), "headless": True,
            "args": CHROMIUM_ARGS}


@pytest.fixture(scope="session")
def browser_context_args(browser_context_args):
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    return {**browser_context_args, "viewport": {"width": 1500, "height": 1000}}


@pytest.fixture(scope="session")
def lab(chromium_path, tmp_path_factory):
    server = LabServer.start(NOTEBOOKS, tmp_path_factory.mktemp("jupyterlab"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def shots(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("browser-screenshots")
    _SHOTS.append(folder)
    return folder


@pytest.fixture
def page(page, lab):
    page.set_default_timeout(TIMEOUT_MS)
    try:
        yield page
    finally:
        page.context.close()
        for session in lab.api("GET", "/api/sessions") or []:
            lab.api("DELETE", f"/api/sessions/{session['id']}")


def pytest_terminal_summary(terminalreporter):
    for folder in _SHOTS:
        if any(folder.iterdir()):
            terminalreporter.write_line(f"browser screenshots: {folder}")
