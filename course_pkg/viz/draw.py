"""Draw a snapshot of the KV-cache bookkeeping with matplotlib (a picture per step).

One figure shows the four structures of the BlockManager plus the block tables:

* the block pool as a grid, one cell per physical block, coloured by state -- free,
  free but still cached (hatched), exclusive (ref count 1), shared (ref count > 1) -- with
  the block id, the ref count, the short hash and the sequences that hold it;
* each sequence's block table as a row of boxes (logical block i -> physical id, coloured
  like the pool cell it points at); each pool cell names the sequences that hold it;
* the hash index (short hash -> block id, and the tokens the block holds);
* the free queue as a strip from its head (reused next) to its tail (freed last).

Everything is drawn in one axes whose units are "cells", sized so that text stays legible
when the figure is projected. Figures are built with ``matplotlib.figure.Figure`` (not
pyplot), so a notebook shows each figure exactly once, where ``show`` puts it.
"""
from __future__ import annotations

import io
import math
from collections.abc import Sequence as SequenceABC

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from course_pkg.viz.snapshot import Snapshot, render_text, short_hash

# Fill colours by state (light fills keep black text readable; orange vs blue is safe for
# the common colour-vision deficiencies).
STATE_COLORS = {
    "free": "#ffffff",
    "cached": "#e4e4e4",
    "exclusive": "#a6cee3",
    "shared": "#fdbf6f",
}
STATE_LABELS = {
    "free": "free",
    "cached": "free, still cached",
    "exclusive": "exclusive (ref 1)",
    "shared": "shared (ref > 1)",
}
CACHED_HATCH = "///"
EDGE = "#555555"
# One colour per sequence name.
SEQ_COLORS = ["#1f5fa8", "#c0392b", "#2e8b57", "#7d3c98", "#b8860b", "#117a8b", "#6d4c41", "#444444"]

INCH_PER_UNIT = 0.62   # one pool cell is ~0.6 inch: ref counts stay readable on a projector
MAX_FREE_SHOWN = 24    # longer free queues are drawn head ... tail
MAX_INDEX_SHOWN = 12   # longer hash indexes end in "... n more"
MAX_TOKENS_SHOWN = 6
MAX_TABLES_SHOWN = 10  # more sequences end in "... n more sequences"
MAX_ENTRIES_SHOWN = 16 # longer block tables are drawn first entries ... last entries


def _pool_columns(num_blocks: int) -> int:
    if num_blocks <= 8:
        return num_blocks
    if num_blocks <= 32:
        return 8
    if num_blocks <= 128:
        return 16
    return 32


def _shown_entries(table: tuple[int, ...]) -> list[tuple[int, int] | None]:
    """(logical index, block id) pairs to draw; None marks the elided middle of a long table."""
    pairs: list[tuple[int, int] | None] = list(enumerate(table))
    if len(pairs) > MAX_ENTRIES_SHOWN:
        pairs = pairs[:MAX_ENTRIES_SHOWN - 4] + [None] + pairs[-3:]
    return pairs


def _owner_tag(names: list[str]) -> str:
    """Who holds a pool cell, when it fits next to the block id (the ref count says how many)."""
    tag = ",".join(names)
    return tag if len(tag) <= 5 else ""


class _Layout:
    """Where each part of one snapshot goes, in cell units (x to the right, y downward from 0)."""

    def __init__(self, snap: Snapshot, legend: bool = True):
        self.snap = snap
        self.legend = legend
        n = snap.num_blocks
        self.ncols = _pool_columns(n)
        self.nrows = math.ceil(n / self.ncols)
        self.tables = snap.block_tables[:MAX_TABLES_SHOWN]
        names = [name for name, _ in self.tables]
        self.name_w = max([1.2] + [0.28 * len(name) + 0.6 for name in names])
        max_len = max([0] + [len(_shown_entries(t)) for _, t in self.tables])
        self.tables_w = max(5.2, self.name_w + max_len * 1.0)
        self.pool_x = self.tables_w + 1.2
        self.pool_w = max(self.ncols * 1.0, 6.8)   # at least as wide as its heading
        self.index_x = self.pool_x + self.pool_w + 1.0
        self.index_w = 7.0
        self.top = -1.4                       # first row of tables and pool
        index_lines = min(len(snap.hash_index), MAX_INDEX_SHOWN) + (len(snap.hash_index) > MAX_INDEX_SHOWN)
        table_rows = len(self.tables) + (len(snap.block_tables) > MAX_TABLES_SHOWN)
        main_h = max(self.nrows, table_rows, 1, 0.5 * max(index_lines, 1))
        self.free_y = self.top - main_h - 1.3   # top of the free-queue strip
        self.legend_y = self.free_y - 1.6 if legend else self.free_y - 0.85
        n_free = len(snap.free_queue)
        n_free_shown = n_free if n_free <= MAX_FREE_SHOWN else MAX_FREE_SHOWN + 1
        self.free_w = 2.6 + 0.9 * max(n_free_shown, 1) + 1.6
        self.width = max(self.index_x + self.index_w, self.free_w, 17.0)
        self.height = -self.legend_y + (0.6 if legend else 0.3)

    def cell_xy(self, block_id: int) -> tuple[float, float]:
        """Lower-left corner of a pool cell."""
        r, c = divmod(block_id, self.ncols)
        return self.pool_x + c + 0.05, self.top - r - 0.95


def _owners(snap: Snapshot) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for name, table in snap.block_tables:
        for block_id in table:
            owners.setdefault(block_id, [])
            if name not in owners[block_id]:
                owners[block_id].append(name)
    return owners


def _cell(ax, x, y, w, h, state, **kw):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=STATE_COLORS[state], edgecolor=EDGE, lw=1.2,
                           hatch=CACHED_HATCH if state == "cached" else None, zorder=2, **kw))


def _draw_into(ax, snap: Snapshot, layout: _Layout, title: str | None) -> None:
    L = layout
    ax.set_axis_off()
    if title:
        ax.text(0, -0.35, title, fontsize=15, fontweight="bold", va="center", ha="left", family="monospace")

    # Section headings.
    head_y = L.top + 0.35
    ax.text(0, head_y, "block tables (logical -> physical)", fontsize=11, va="center", color="#333333")
    ax.text(L.pool_x, head_y, f"block pool ({snap.num_blocks} blocks of {snap.block_size} tokens)",
            fontsize=11, va="center", color="#333333")
    ax.text(L.index_x, head_y, "hash index (hash -> block)", fontsize=11, va="center", color="#333333")

    # The pool.
    owners = _owners(snap)
    for b in snap.blocks:
        x, y = L.cell_xy(b.block_id)
        state = snap.state(b.block_id)
        _cell(ax, x, y, 0.9, 0.9, state)
        ax.text(x + 0.06, y + 0.8, str(b.block_id), fontsize=9, va="center", ha="left", color="#222222",
                zorder=3)
        if b.ref_count:
            ax.text(x + 0.45, y + 0.47, f"ref {b.ref_count}", fontsize=11, fontweight="bold",
                    va="center", ha="center", zorder=3)
        elif state == "cached":
            ax.text(x + 0.45, y + 0.47, "cached", fontsize=8.5, va="center", ha="center", zorder=3,
                    bbox=dict(facecolor="white", edgecolor="none", pad=0.5))
        if b.hash != -1:
            ax.text(x + 0.45, y + 0.14, short_hash(b.hash), fontsize=8, va="center", ha="center",
                    family="monospace", color="#333333", zorder=3,
                    bbox=dict(facecolor="white", edgecolor="none", pad=0.3) if state == "cached" else None)
        if b.block_id in owners:
            ax.text(x + 0.86, y + 0.8, _owner_tag(owners[b.block_id]), fontsize=8.5, va="center",
                    ha="right", color="#222222", zorder=3)

    # Block tables: entry i holds the physical block id of logical block i.
    for row, (name, table) in enumerate(L.tables):
        color = SEQ_COLORS[row % len(SEQ_COLORS)]
        y = L.top - row - 0.95
        ax.text(L.name_w - 0.3, y + 0.45, name, fontsize=12, fontweight="bold", color=color,
                va="center", ha="right")
        for k, entry in enumerate(_shown_entries(table)):
            x = L.name_w + k * 1.0
            if entry is None:
                ax.text(x + 0.425, y + 0.45, "...", fontsize=12, va="center", ha="center")
                continue
            i, block_id = entry
            _cell(ax, x, y + 0.05, 0.85, 0.8, snap.state(block_id))
            ax.text(x + 0.425, y + 0.45, str(block_id), fontsize=12, va="center", ha="center", zorder=3)
            ax.text(x + 0.05, y + 0.72, f"{i}", fontsize=8, color="#555555", va="center", ha="left",
                    zorder=3)
    if len(snap.block_tables) > len(L.tables):
        ax.text(0.1, L.top - len(L.tables) - 0.5, f"... {len(snap.block_tables) - len(L.tables)} more sequences",
                fontsize=10, color="#555555", va="center")
    if not snap.block_tables:
        ax.text(0.1, L.top - 0.5, "(no sequence holds blocks)", fontsize=10, color="#777777", va="center")

    # Hash index.
    entries = list(snap.hash_index)
    shown = entries[:MAX_INDEX_SHOWN]
    for k, (h, block_id) in enumerate(shown):
        toks = snap.blocks[block_id].token_ids
        tok_text = " ".join(map(str, toks[:MAX_TOKENS_SHOWN])) + (" ..." if len(toks) > MAX_TOKENS_SHOWN else "")
        ax.text(L.index_x, L.top - 0.3 - 0.5 * k, f"{short_hash(h)} -> {block_id:<3d} [{tok_text}]",
                fontsize=9.5, family="monospace", va="center")
    if len(entries) > MAX_INDEX_SHOWN:
        ax.text(L.index_x, L.top - 0.3 - 0.5 * len(shown), f"... {len(entries) - MAX_INDEX_SHOWN} more",
                fontsize=9.5, family="monospace", va="center")
    if not entries:
        ax.text(L.index_x, L.top - 0.3, "(empty)", fontsize=9.5, color="#777777", va="center")

    # Free queue strip: head (reused next) on the left, tail (freed last) on the right.
    fy = L.free_y
    ax.text(0, fy + 0.35, f"free queue ({len(snap.free_queue)} blocks)", fontsize=11, va="center",
            color="#333333")
    ax.text(0, fy - 0.45, "head\n(next)", fontsize=9, va="center", ha="left", color="#333333")
    queue = list(snap.free_queue)
    if len(queue) > MAX_FREE_SHOWN:
        items: list[int | None] = queue[:MAX_FREE_SHOWN - 3] + [None] + queue[-3:]
    else:
        items = list(queue)
    x = 1.5
    for item in items:
        if item is None:
            ax.text(x + 0.4, fy - 0.45, "...", fontsize=11, va="center", ha="center")
        else:
            _cell(ax, x, fy - 0.85, 0.8, 0.8, snap.state(item))
            ax.text(x + 0.4, fy - 0.45, str(item), fontsize=11, va="center", ha="center", zorder=3,
                    bbox=dict(facecolor="white", edgecolor="none", pad=0.3)
                    if snap.state(item) == "cached" else None)
        x += 0.9
    if not items:
        ax.text(x, fy - 0.45, "(empty)", fontsize=10, color="#777777", va="center")
        x += 1.2
    ax.text(x + 0.1, fy - 0.45, "tail\n(freed last)", fontsize=9, va="center", ha="left", color="#333333")

    if L.legend:
        _draw_legend(ax, L.legend_y)


def _draw_legend(ax, y: float) -> None:
    x = 0.0
    for s in ("free", "cached", "exclusive", "shared"):
        _cell(ax, x, y - 0.2, 0.5, 0.4, s)
        ax.text(x + 0.65, y, STATE_LABELS[s], fontsize=10, va="center", ha="left")
        x += 0.65 + 0.16 * len(STATE_LABELS[s]) + 0.8


def _frame(ax, width: float, height: float) -> None:
    ax.set_xlim(-0.2, width)
    ax.set_ylim(-height, 0.2)
    ax.set_aspect("equal")


def draw_snapshot(snap: Snapshot, title: str | None = None) -> Figure:
    """The state in one snapshot as a matplotlib Figure (see the module docstring).

    ``title`` defaults to the snapshot's label.
    """
    layout = _Layout(snap)
    fig = Figure(figsize=((layout.width + 0.4) * INCH_PER_UNIT, (layout.height + 0.4) * INCH_PER_UNIT))
    ax = fig.add_axes((0, 0, 1, 1))
    _draw_into(ax, snap, layout, snap.label if title is None else title)
    _frame(ax, layout.width + 0.2, layout.height + 0.2)
    return fig


def draw_steps(snapshots: SequenceABC[Snapshot], ncols: int = 2, title: str | None = None) -> Figure:
    """Small multiples: several snapshots side by side, each panel titled with its label.

    The static view of a recorded run, for readers who see the notebook without a kernel.
    Every panel uses the same scale, so cells have the same size in all of them.
    """
    snaps = list(snapshots)
    if not snaps:
        raise ValueError("draw_steps needs at least one snapshot")
    if not isinstance(ncols, int) or ncols < 1:
        raise ValueError(f"ncols must be an integer >= 1, got {ncols!r}")
    layouts = [_Layout(s, legend=False) for s in snaps]   # one legend for the whole figure
    w = max(lay.width for lay in layouts) + 0.4
    h = max(lay.height for lay in layouts) + 0.4
    ncols = min(ncols, len(snaps))
    nrows = math.ceil(len(snaps) / ncols)
    top = 0.9 if title else 0.0
    legend_h = 1.0
    total_h = nrows * h + top + legend_h
    fig = Figure(figsize=(ncols * w * INCH_PER_UNIT, total_h * INCH_PER_UNIT))
    for k, (snap, layout) in enumerate(zip(snaps, layouts)):
        r, c = divmod(k, ncols)
        ax = fig.add_axes((c / ncols, 1 - (top + (r + 1) * h) / total_h, 1 / ncols, h / total_h))
        _draw_into(ax, snap, layout, f"{k + 1}. {snap.label}" if snap.label else f"step {k + 1}")
        _frame(ax, w - 0.2, h - 0.2)
    ax = fig.add_axes((0, 0, 1, legend_h / total_h))
    ax.set_axis_off()
    _draw_legend(ax, -0.5)
    _frame(ax, ncols * w - 0.2, legend_h - 0.2)
    if title:
        fig.text(0.01, 1 - 0.45 / total_h, title, fontsize=17, fontweight="bold", va="center")
    return fig


def figure_png(fig: Figure, dpi: int = 100) -> bytes:
    """PNG bytes of a figure, without metadata that varies between machines."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor="white", metadata={"Software": None})
    return buf.getvalue()


def show(snap: Snapshot, title: str | None = None) -> None:
    """Print the snapshot's text and display its figure: one call per step in a notebook.

    The text is what nbval checks; the PNG is what a reader on the web sees.
    """
    from IPython.display import Image, display

    print(render_text(snap))
    display(Image(data=figure_png(draw_snapshot(snap, title)), format="png"))
