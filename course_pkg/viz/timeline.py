"""Who runs in each step: a served trace as a grid of requests x steps (chapter 09).

Each cell says what one request did in one step: ``P`` it computed prompt tokens (a whole
prompt, a chunk, or a recomputation after preemption), ``d`` it decoded one token, ``.`` it had
arrived and was not finished but did not run -- a *stall* when it already had tokens -- and a
blank: not arrived yet, or finished. The same grid as text (deterministic, for nbval) and as
a matplotlib image.
"""
from __future__ import annotations

from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

CODES = {" ": 0, ".": 1, "P": 2, "d": 3}
COLORS = ["white", "#f4a3a3", "#4c72b0", "#55a868"]     # blank, waiting/stalled, prompt, decode


def timeline(result, names: dict[int, str] | None = None) -> dict[str, str]:
    """Request name -> one character per step (see the module docstring)."""
    rows = {}
    for req in result.requests:
        name = names.get(req.request_id, str(req.request_id)) if names else str(req.request_id)
        last = req.token_steps[-1]
        cells = []
        for start, step in zip(result.step_clock, result.steps):
            mine = [(first, n) for rid, first, n in step.scheduled if rid == req.request_id]
            if mine:
                first, n = mine[0]
                cells.append("d" if n == 1 and first >= req.prompt_len else "P")
            elif req.arrival <= start and step.step <= last:
                cells.append(".")
            else:
                cells.append(" ")
        rows[name] = "".join(cells)
    return rows


def render_timeline(result, names: dict[int, str] | None = None, title: str = "") -> str:
    rows = timeline(result, names)
    width = max([4] + [len(n) for n in rows])
    num_steps = len(result.steps)
    ruler = "".join(str(i // 10 % 10) if i % 10 == 0 else " " for i in range(num_steps))
    lines = [title] if title else []
    lines.append(f"{'step':>{width}} |{ruler}|")
    lines += [f"{name:>{width}} |{row}|" for name, row in rows.items()]
    return "\n".join(lines)


def draw_timeline(ax, result, names: dict[int, str] | None = None, title: str = "") -> None:
    """The grid as an image on ``ax``: one row per request, one column per step."""
    rows = timeline(result, names)
    grid = [[CODES[c] for c in row] for row in rows.values()]
    ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=ListedColormap(COLORS), vmin=0, vmax=3)
    ax.set_yticks(range(len(rows)), list(rows))
    ax.set_xlabel("engine step")
    ax.set_title(title)


def timeline_figure(results: dict[str, object], names: dict[int, str] | None = None) -> Figure:
    """One grid per policy, stacked, with a legend."""
    from matplotlib.patches import Patch

    fig = Figure(figsize=(12, 2.2 * len(results) + 0.6), layout="constrained")
    axes = fig.subplots(len(results), 1, squeeze=False)[:, 0]
    for ax, (label, result) in zip(axes, results.items()):
        draw_timeline(ax, result, names, title=label)
    labels = ["waiting / stalled", "prompt tokens", "decode token"]
    fig.legend([Patch(color=c) for c in COLORS[1:]], labels, loc="outside lower center", ncols=3)
    return fig
