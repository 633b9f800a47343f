"""Execute notebooks in place and strip what differs between machines and runs.

    python tools/execute_notebooks.py notebooks/02_block_manager.ipynb [...]

Each notebook runs top to bottom in a fresh kernel from its own folder, with the
environment of `make test` (offline, fixed hash seed). Cell timing metadata is not
recorded, so a committed notebook holds only outputs, in order, and the widget state that
lets a reader on the web see the widgets' last view.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

KERNEL = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def clean(nb: nbformat.NotebookNode) -> None:
    nb.metadata = nbformat.NotebookNode(
        {k: v for k, v in nb.metadata.items() if k in ("kernelspec", "language_info", "widgets", "celltoolbar")})
    nb.metadata["kernelspec"] = KERNEL
    li = nb.metadata.get("language_info", {})
    nb.metadata["language_info"] = {"name": "python", "pygments_lexer": "ipython3",
                                    "codemirror_mode": li.get("codemirror_mode", {"name": "ipython", "version": 3}),
                                    "file_extension": ".py", "mimetype": "text/x-python",
                                    "nbconvert_exporter": "python"}
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        cell.metadata.pop("ExecuteTime", None)


def execute(path: Path, timeout: int = 600) -> float:
    nb = nbformat.read(path, as_version=4)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("PYTHONHASHSEED", "0")
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            store_widget_state=True, resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    clean(nb)
    nbformat.write(nb, path)
    return elapsed


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        t = execute(Path(arg))
        print(f"{arg}: executed in {t:.1f} s")
