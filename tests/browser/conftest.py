"""Fixtures for the browser tests: Debian's Chromium (via playwright) and a throw-away JupyterLab.

- ``chromium_path``: the Chromium binary, or a skip with the reason when this machine has none
  (``tools/ensure_chromium.sh``, run by ``make test``, installs it on Debian-like systems).
  The tests never download a browser: playwright drives this binary via ``executable_path``.
- ``lab``: one JupyterLab per test session on 127.0.0.1, serving a *copy* of notebooks/ from a
  temporary folder; stopped (sessions, kernels, server) at the end of the session.
- ``page``: a fresh browser page per test; the test's kernels are shut down after it.
- ``shots``: the folder the screenshots go to (printed at the end of the run; look at them).
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


@pytest.fixture(scope="session")
def browser(chromium_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(chromium_path), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="session")
def lab(browser, tmp_path_factory):
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
def page(browser, lab):
    context = browser.new_context(viewport={"width": 1500, "height": 1000})
    context.set_default_timeout(30_000)
    page = context.new_page()
    try:
        yield page
    finally:
        context.close()
        for session in lab.api("GET", "/api/sessions") or []:
            lab.api("DELETE", f"/api/sessions/{session['id']}")


def pytest_terminal_summary(terminalreporter):
    for folder in _SHOTS:
        if any(folder.iterdir()):
            terminalreporter.write_line(f"browser screenshots: {folder}")
