"""Execute notebooks in place and strip what differs between machines and runs.

    python tools/execute_notebooks.py notebooks/02_block_manager.ipynb [...]

Each notebook runs top to bottom in a fresh kernel from its own folder, with the
environment of `make test` (offline, fixed hash seed). Cell timing metadata is not
recorded, so a committed notebook holds only outputs, in order, and the widget state that
lets a reader on the web see the widgets' last view.
"""
from __future__ import annotations

import json
import os
import re
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


WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def renumber_widgets(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Replace the widgets' random model ids by numbers given in a fixed order.

    Each run creates new random ids; renumbering them (outputs first, then what they refer to,
    depth first) makes re-executing an unchanged notebook produce an unchanged file.
    """
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    if not state:
        return nb
    order: list[str] = []

    def visit(model_id: str) -> None:
        if model_id in state and model_id not in order:
            order.append(model_id)
            for ref in re.findall(r"IPY_MODEL_([0-9a-f]{32})", json.dumps(state[model_id])):
                visit(ref)

    for cell in nb.cells:
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(WIDGET_VIEW)
            if view:
                visit(view["model_id"])
    # Models nothing refers to (e.g. a jslink between two widgets) come last, in a stable order.
    rest = sorted((m for m in state if m not in order),
                  key=lambda m: (state[m].get("model_name", ""), re.sub(r"[0-9a-f]{32}", "", json.dumps(state[m], sort_keys=True))))
    for model_id in rest:
        visit(model_id)
    text = nbformat.writes(nb)
    for n, model_id in enumerate(order):
        text = text.replace(model_id, f"{n + 1:032x}")
    nb = nbformat.reads(text, as_version=4)
    widgets = nb.metadata["widgets"][WIDGET_STATE]
    widgets["state"] = dict(sorted(widgets["state"].items()))
    return nb


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
    nbformat.write(renumber_widgets(nb), path)
    return elapsed


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        t = execute(Path(arg))
        print(f"{arg}: executed in {t:.1f} s")
