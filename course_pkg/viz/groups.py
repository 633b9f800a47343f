"""A hybrid model's KV cache groups, step by step (chapter 16): every group's block table per
sequence, and the one pool they share -- which group holds each block, its ref count, whether a
free block is still cached -- as text and as a figure."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

NULL = -1
GROUP_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3"]


@dataclass(frozen=True)
class GroupsSnapshot:
    """The state after one step: ``tables[name][g]`` is sequence ``name``'s table in group ``g``
    (NULL where a block left the window); ``blocks[b] = (group, ref_count, cached)`` (group -1:
    a block no group has used yet); ``free_queue`` head first."""

    label: str
    block_size: int
    windows: tuple
    tables: dict
    num_tokens: dict
    num_computed: dict
    blocks: tuple
    free_queue: tuple


class GroupsRecorder:
    """Takes ``GroupsSnapshot``s of a ``HybridBlockManager``. A free block keeps the group that
    last held it for as long as it stays cached (the pool alone does not say whose it was)."""

    def __init__(self, block_manager):
        self.bm = block_manager
        self.windows = (None, *(g.sliding_window for g in getattr(block_manager, "groups", ())))
        self._last_group: dict[int, int] = {}

    def snap(self, seqs: Mapping[str, object], label: str = "") -> GroupsSnapshot:
        bm = self.bm
        tables, lengths, computed = {}, {}, {}
        for name, seq in seqs.items():
            groups = (tuple(seq.block_table), *(tuple(t) for t in seq.group_block_tables))
            if not seq.block_table:
                continue
            tables[name], lengths[name], computed[name] = groups, seq.num_tokens, seq.num_cached_tokens
            for g, table in enumerate(groups):
                for b in table:
                    if b != NULL:
                        self._last_group[b] = g
        for seq in bm._holders.values():   # (sequences not named are still holders of the pool)
            for g, table in enumerate((seq.block_table, *seq.group_block_tables)):
                for b in table:
                    if b != NULL:
                        self._last_group[b] = g
        blocks = []
        for block in bm.blocks:
            cached = block.hash != -1
            group = self._last_group.get(block.block_id, -1) if (block.ref_count or cached) else -1
            blocks.append((group, block.ref_count, cached))
        return GroupsSnapshot(label, bm.block_size, self.windows, tables, lengths, computed, tuple(blocks),
                              tuple(bm.free_block_ids))


def _group_name(g: int, window) -> str:
    return f"group {g} ({'full' if window is None else f'window {window}'})"


def render_groups(snap: GroupsSnapshot) -> str:
    """The snapshot as text: each sequence's tables, then the pool, then the free queue."""
    lines = [snap.label] if snap.label else []
    width = max(len(_group_name(g, w)) for g, w in enumerate(snap.windows))
    for name, groups in snap.tables.items():
        lines.append(f"  {name}: {snap.num_tokens[name]} tokens, {snap.num_computed[name]} computed")
        for g, table in enumerate(groups):
            cells = " ".join(f"{b:>2}" if b != NULL else " -" for b in table)
            held = sum(1 for b in table if b != NULL)
            lines.append(f"    {_group_name(g, snap.windows[g]):<{width}} [{cells}]  holds {held}")
    ids = range(len(snap.blocks))
    lines.append("  block  " + " ".join(f"{b:>2}" for b in ids))
    lines.append("  group  " + " ".join(f"{g:>2}" if g >= 0 else "  " for g, _, _ in snap.blocks))
    lines.append("  refs   " + " ".join(f"{r:>2}" for _, r, _ in snap.blocks))
    lines.append("  cached " + " ".join(" *" if c else "  " for _, _, c in snap.blocks))
    queue = " ".join(f"{b}{'*' if snap.blocks[b][2] else ''}" for b in snap.free_queue)
    lines.append(f"  free queue, head first (* still cached): {queue}")
    lines.append("  (-: a block given back; a blank group: never held; refs 0: free)")
    return "\n".join(lines)


def draw_groups_steps(snaps: Sequence[GroupsSnapshot], title: str | None = None) -> Figure:
    """One row per snapshot: every sequence's tables (a row per group, ``g0``, ``g1``, ...: a cell
    per logical block holding its block id, colored by group, grey where the block left the
    window) on the left, the pool on the right (each cell a block id -- held: the group's color,
    with ``xN`` when N sequences share it; free but cached: pale; free and empty: white)."""
    max_blocks = max((len(t) for s in snaps for groups in s.tables.values() for t in groups), default=1)
    num_rows = max(sum(len(groups) for groups in s.tables.values()) for s in snaps)
    pool = len(snaps[0].blocks)
    pool_cols = min(pool, 16)
    pool_rows = -(-pool // pool_cols)
    row_h = max(num_rows, pool_rows) + 1.2
    fig = Figure(figsize=(0.32 * (max_blocks + pool_cols) + 3.2, 0.3 * row_h * len(snaps) + 0.6),
                 layout="constrained")
    ax = fig.add_subplot()
    y0 = 0.0
    x_pool = max_blocks + 3.0
    for snap in snaps:
        ax.text(-3.1, y0 - 0.45, snap.label, fontsize=8, fontweight="bold", va="center")
        y = y0 - 1.2
        for name, groups in snap.tables.items():
            for g, table in enumerate(groups):
                ax.text(-0.2, y + 0.45, f"{name} g{g}", fontsize=7, ha="right", va="center")
                for i, b in enumerate(table):
                    color = "#DDDDDD" if b == NULL else GROUP_COLORS[g % len(GROUP_COLORS)]
                    ax.add_patch(Rectangle((i, y), 0.92, 0.9, facecolor=color, edgecolor="white"))
                    ax.text(i + 0.46, y + 0.45, "–" if b == NULL else str(b), fontsize=6, ha="center",
                            va="center", color="black" if b == NULL else "white")
                y -= 1.0
        for b, (g, refs, cached) in enumerate(snap.blocks):
            col, row = b % pool_cols, b // pool_cols
            px, py = x_pool + col, y0 - 1.2 - row
            if refs:
                face, alpha = GROUP_COLORS[g % len(GROUP_COLORS)], 1.0
            elif cached and g >= 0:
                face, alpha = GROUP_COLORS[g % len(GROUP_COLORS)], 0.3
            else:
                face, alpha = "white", 1.0
            ax.add_patch(Rectangle((px, py), 0.92, 0.9, facecolor=face, alpha=alpha, edgecolor="#999999",
                                   linewidth=0.5))
            ax.text(px + 0.46, py + 0.45, str(b) + (f"x{refs}" if refs > 1 else ""), fontsize=5.5, ha="center",
                    va="center", color="white" if refs else "#777777")
        y0 -= row_h
    ax.text(x_pool, 0.35, "the pool: block ids (pale: free but still cached; white: free)", fontsize=7)
    windows = snaps[0].windows
    for g, w in enumerate(windows):   # the legend: a swatch per group
        ax.add_patch(Rectangle((-3.1 + 3.4 * g, 0.25), 0.6, 0.5, facecolor=GROUP_COLORS[g % len(GROUP_COLORS)]))
        ax.text(-3.1 + 3.4 * g + 0.8, 0.5, f"g{g}: {_group_name(g, w)}", fontsize=6.5, va="center")
    ax.set_xlim(-3.2, x_pool + pool_cols + 0.2)
    ax.set_ylim(y0 + 0.2, 1.0)
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=9)
    return fig
