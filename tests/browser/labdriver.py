"""Drive a throw-away JupyterLab from a test: start it, talk to its REST API, shut it down.

The browser tests open the course's chapters the way a student does: in JupyterLab, in
Chromium. This module owns the server side of that:

- `LabServer.start(notebooks, workdir)` copies the notebooks into ``workdir`` (JupyterLab
  autosaves outputs into the files it opens, so the repository's copies are never served),
  gives the server a throw-away HOME, config, runtime and settings folder, a random token and
  a fixed free port on 127.0.0.1, and waits (bounded) until ``/api/status`` answers.
- `LabServer.stop()` deletes every session and kernel through the REST API, asks the server
  to shut down, and kills its process group only if it has not exited within a bounded wait.

Every wait here has a deadline and raises `TimeoutError` naming what it waited for.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"

# User settings written into the throw-away settings folder: no news toast over the page,
# and every cell kept in the DOM (windowed rendering would drop cells scrolled out of view).
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, what: str, interval: float = 0.25):
    """Poll ``predicate`` until it returns something truthy; raise TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - remembered and reported on timeout
            last_error = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}"
                       + (f" (last error: {last_error!r})" if last_error else ""))


@dataclass
class LabServer:
    workdir: Path
    root: Path
    port: int
    token: str
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    _log: object = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def notebook_url(self, name: str) -> str:
        return f"{self.base_url}/lab/tree/{name}?token={self.token}"

    # --- lifecycle -------------------------------------------------------------------------
    @classmethod
    def start(cls, notebooks: Path, workdir: Path, timeout: float = 60.0) -> "LabServer":
        workdir.mkdir(parents=True, exist_ok=True)
        root = workdir / "notebooks"
        shutil.copytree(notebooks, root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        home = workdir / "home"
        settings = home / "lab-user-settings"
        for rel, value in LAB_SETTINGS.items():
            path = settings / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))
        server = cls(workdir=workdir, root=root, port=free_port(), token=secrets.token_hex(16))
        env = dict(os.environ)
        env.update({
            "HOME": str(home),
            "JUPYTER_CONFIG_DIR": str(home / ".jupyter"),
            "JUPYTER_DATA_DIR": str(home / ".local/share/jupyter"),
            "JUPYTER_RUNTIME_DIR": str(workdir / "runtime"),
            "JUPYTERLAB_SETTINGS_DIR": str(settings),
            "JUPYTERLAB_WORKSPACES_DIR": str(home / "lab-workspaces"),
            "IPYTHONDIR": str(home / ".ipython"),
            "MPLCONFIGDIR": str(home / ".matplotlib"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONHASHSEED": "0",
        })
        env.pop("JUPYTER_PATH", None)
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={server.port}",
               "--ServerApp.port_retries=0", f"--IdentityProvider.token={server.token}",
               f"--ServerApp.root_dir={root}", "--ServerApp.open_browser=False",
               "--LabApp.news_url=None",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        server.log_path = workdir / "jupyterlab.log"
        server._log = open(server.log_path, "wb")
        server.proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=server._log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until(lambda: server._alive() and server.api("GET", "/api/status"), timeout,
                       f"JupyterLab on port {server.port} (log: {server.log_path})")
        except BaseException:
            server.stop()
            raise
        return server

    def _alive(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}: {self.log_tail()}")
        return True

    def log_tail(self, n: int = 3000) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def stop(self, timeout: float = 15.0) -> None:
        """Delete sessions and kernels, shut the server down, and reap it (kill if it hangs)."""
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None:
                for session in self.api("GET", "/api/sessions") or []:
                    self.api("DELETE", f"/api/sessions/{session['id']}")
                for kernel in self.api("GET", "/api/kernels") or []:
                    self.api("DELETE", f"/api/kernels/{kernel['id']}")
                self.api("POST", "/api/shutdown")
        except (OSError, urllib.error.URLError):
            pass  # the server is already going away; reaping below still bounds the wait
        finally:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # The server runs in a process group of its own (start_new_session): this ends
                # it and the kernels it started, nothing else.
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout)
            if self._log:
                self._log.close()
            self.proc = None

    # --- REST API ----------------------------------------------------------------------------
    def api(self, method: str, path: str, body: dict | None = None, timeout: float = 10.0):
        """Call the server's REST API with the token; return the decoded JSON (or None)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def kernel_state(self, notebook: str) -> str | None:
        """Execution state of the kernel of the session for ``notebook`` (None: no session yet)."""
        for session in self.api("GET", "/api/sessions") or []:
            if session.get("path") == notebook and session.get("kernel"):
                return session["kernel"].get("execution_state")
        return None

    def running_kernels(self) -> list[dict]:
        return self.api("GET", "/api/kernels") or []


# --- the notebook page ----------------------------------------------------------------------
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

_CELL_STATE_JS = """() => Array.from(document.querySelectorAll('.jp-Notebook .jp-CodeCell')).map(c => ({
    prompt: (c.querySelector('.jp-InputArea-prompt') || {textContent: ''}).textContent.trim(),
    source: (c.querySelector('.cm-content') || {textContent: ''}).textContent,
    errors: Array.from(c.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'))
                 .map(e => e.textContent).join('\\n'),
}))"""


def open_notebook(page, lab: LabServer, name: str, timeout: float = 60.0) -> None:
    """Open ``name`` in its own JupyterLab workspace and wait until its kernel is idle.

    A workspace per notebook keeps JupyterLab from restoring tabs that an earlier test opened.
    """
    workspace = "t-" + "".join(ch if ch.isalnum() else "-" for ch in name)
    page.goto(f"{lab.base_url}/lab/workspaces/{workspace}/tree/{name}?reset&token={lab.token}")
    page.locator(".jp-NotebookPanel .jp-Notebook").first.wait_for(state="visible", timeout=timeout * 1000)
    wait_until(lambda: lab.kernel_state(name) == "idle", timeout, f"the kernel of {name} to be idle")


def clear_outputs(notebook: Path) -> None:
    """Drop the outputs and execution counts of a (temporary copy of a) notebook.

    A run then shows plainly which cells ran: every code cell gets a number, and none of the
    prompts on the page can be left over from the outputs saved in the repository.
    """
    nb = nbformat.read(notebook, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nbformat.write(nb, notebook)


def _ran(cell: dict) -> bool:
    prompt = cell["prompt"]
    return prompt.startswith("[") and prompt.endswith("]:") and prompt[1:-2].isdigit()


def run_all_cells(page, lab: LabServer, name: str, timeout: float = 120.0) -> list[dict]:
    """Run > Run All Cells, as a student would, and wait (bounded) until every cell has run.

    The notebook must have been opened without outputs (see `clear_outputs`). Returns the
    code cells' prompts and stderr text. Raises AssertionError naming the first code cell that
    did not run (JupyterLab stops a run at the first error), with the errors shown.
    """
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()

    def finished():
        cells = [c for c in page.evaluate(_CELL_STATE_JS) if c["source"].strip()]
        if any(c["prompt"] == "[*]:" for c in cells) or lab.kernel_state(name) != "idle":
            return None  # still running
        if all(_ran(c) for c in cells) or any(c["errors"] and _ran(c) for c in cells):
            return cells  # all ran, or the run stopped at an error
        return None  # not started yet

    def finished_twice():  # the kernel is idle for an instant between two queued cells
        if finished():
            time.sleep(0.5)
            return finished()
        return None

    cells = wait_until(finished_twice, timeout, f"all cells of {name} to finish running", interval=0.5)
    for index, cell in enumerate(cells):
        if not _ran(cell):
            raise AssertionError(f"{name}: code cell {index} did not run (prompt {cell['prompt']!r}); "
                                 f"errors shown: {' | '.join(c['errors'][-800:] for c in cells if c['errors'])}")
    return cells
