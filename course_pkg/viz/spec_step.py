"""One speculative step drawn slot by slot (chapter 14): the drafts' slots, the verification, the rollback.

Four panels, one row of blocks each, one cell per slot of the sequence's blocks: before the step
(the K/V computed so far and the newest token's slot), the schedule (lookahead slots holding the
drafts), the verification (each draft accepted or rejected) and the rollback (the blocks kept,
and those freed back to the head of the free queue, crossed out). Deterministic text for the same
step is the notebook's printout; this is its picture.
"""
from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from course_pkg.viz.draw import EDGE

#: The state of a slot, and how it is drawn: (face colour, label in the legend).
STATES = {
    "computed": ("#9ecae1", "K/V of a verified token"),
    "newest": ("#ffffff", "the newest token: its slot, computed next step"),
    "draft": ("#fdd49e", "a draft's slot"),
    "accepted": ("#a1d99b", "draft accepted (its K/V kept)"),
    "rejected": ("#fc9272", "draft rejected (K/V overwritten next step)"),
    "empty": ("#f7f7f7", "free slot"),
}


def _panel_states(block_size: int, table: Sequence[int], num_computed: int, newest: int | None,
                  marks: dict[int, str]) -> list[list[str]]:
    rows = []
    for i, _ in enumerate(table):
        row = []
        for off in range(block_size):
            pos = i * block_size + off
            state = marks.get(pos)
            if state is None:
                state = "computed" if pos < num_computed else "newest" if pos == newest else "empty"
            row.append(state)
        rows.append(row)
    return rows


def draw_speculative_step(block_size: int, table_before: Sequence[int], num_tokens_before: int,
                          table_scheduled: Sequence[int], drafts: Sequence[int], num_accepted: int,
                          table_after: Sequence[int], free_queue_before: Sequence[int] = (),
                          free_queue_after: Sequence[int] = ()) -> Figure:
    """A decode step of one sequence with ``len(drafts)`` drafts, ``num_accepted`` of them accepted.

    ``num_tokens_before``: the sequence's tokens before the step (all but the newest computed).
    The tables are the sequence's block tables before the step, once scheduled (lookahead blocks
    appended) and after the rollback. Returns a ``matplotlib.figure.Figure``.
    """
    if not 0 <= num_accepted <= len(drafts):
        raise ValueError(f"{num_accepted} accepted of {len(drafts)} drafts")
    newest = num_tokens_before - 1
    first_draft = num_tokens_before
    draft_pos = {first_draft + i: i for i in range(len(drafts))}
    verified = {first_draft + i: ("accepted" if i < num_accepted else "rejected") for i in range(len(drafts))}
    freed = [b for b in table_scheduled if b not in table_after]
    num_after = num_tokens_before + num_accepted         # computed after the step: old newest + accepted
    panels = [
        (f"1. before the step: {newest} tokens with K/V, the newest (position {newest}) has its slot",
         table_before, _panel_states(block_size, table_before, newest, newest, {}), free_queue_before),
        (f"2. scheduled: {len(drafts)} lookahead slots for the drafts "
         f"({len(table_scheduled) - len(table_before)} blocks from the head of the free queue)",
         table_scheduled, _panel_states(block_size, table_scheduled, newest, newest,
                                        {p: "draft" for p in draft_pos}), ()),
        (f"3. verified in one pass: position {newest} and every draft computed; "
         f"{num_accepted} accepted, the target's token replaces draft {num_accepted + 1}"
         if num_accepted < len(drafts) else
         f"3. verified in one pass: all {len(drafts)} drafts accepted, plus a bonus token",
         table_scheduled, _panel_states(block_size, table_scheduled, newest + 1, None, verified), ()),
        (f"4. after the rollback: {num_after} tokens with K/V; the target's token (position {num_after}) is the "
         f"newest, " + ("its slot taken next step" if num_after >= len(table_after) * block_size else "its slot kept")
         + f"; {len(freed)} block(s) back to the head of the free queue",
         table_scheduled, _panel_states(block_size, table_scheduled, num_after, num_after,
                                        {p: "rejected" for p, s in verified.items()
                                         if s == "rejected" and p > num_after}), free_queue_after),
    ]
    cell_w, cell_h, block_gap = 0.9, 0.8, 0.35
    n_blocks = len(table_scheduled)
    width = n_blocks * (block_size * cell_w + block_gap) + 0.6
    panel_h = 2.3
    height = len(panels) * panel_h + 1.6
    fig = Figure(figsize=(max(width, 11) * 0.62, height * 0.62))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-0.2, max(width, 11))
    ax.set_ylim(height, 0)
    ax.set_axis_off()
    for k, (title, table, rows, queue) in enumerate(panels):
        y0 = k * panel_h + 0.3
        ax.text(0, y0, title, fontsize=9.5, weight="bold", va="center")
        for i, block_id in enumerate(table):
            x0 = i * (block_size * cell_w + block_gap)
            gone = k == 3 and block_id in freed
            ax.text(x0 + block_size * cell_w / 2, y0 + 0.55, f"block {block_id}" + (" (freed)" if gone else ""),
                    fontsize=8, ha="center", va="center", color="#aa0000" if gone else "black")
            for off, state in enumerate(rows[i]):
                pos = i * block_size + off
                x, y = x0 + off * cell_w, y0 + 0.8
                face = STATES["empty" if gone else state][0]
                ax.add_patch(Rectangle((x, y), cell_w * 0.95, cell_h, facecolor=face,
                                       edgecolor=EDGE, linestyle="--" if state == "newest" and not gone else "-",
                                       linewidth=1.2 if state == "newest" else 0.7,
                                       hatch="xx" if gone else None))
                label = str(pos)
                if state in ("draft", "accepted", "rejected") and pos in draft_pos and not gone:
                    label = f"{pos}\nd{draft_pos[pos] + 1}"
                ax.text(x + cell_w * 0.47, y + cell_h / 2, label, fontsize=6.5, ha="center", va="center",
                        color="#888888" if gone else "black")
        if queue:
            ax.text(0, y0 + 1.95, f"free queue (head first): {list(queue)}", fontsize=8, va="center", color="#444444")
    fig.legend(handles=[Patch(facecolor=c, edgecolor=EDGE, label=label) for c, label in STATES.values()]
               + [Patch(facecolor="#f7f7f7", edgecolor=EDGE, hatch="xx", label="block freed by the rollback")],
               loc="lower center", ncol=4, fontsize=7.5, frameon=False)
    return fig
