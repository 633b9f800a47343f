"""How a block table becomes addresses: token -> (logical block, offset) -> physical slot.

Token ``t`` of a sequence lives in physical block ``block_table[t // block_size]`` at offset
``t % block_size``; its *slot* (the row of the flattened cache
``[num_blocks * block_size, num_kv_heads, head_dim]``) is ``block_id * block_size + offset``.
This is the arithmetic both Triton kernels do, shown as text (deterministic, for nbval) and as
a picture: each sequence's logical blocks on the left, arrows into the physical pool on the
right, one cell per slot.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from course_pkg.viz.draw import EDGE, SEQ_COLORS

INCH_PER_UNIT = 0.55


def token_slots(block_table: Sequence[int], block_size: int, num_tokens: int) -> list[int]:
    """The slot of each of the first ``num_tokens`` tokens of a sequence."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_tokens > len(block_table) * block_size:
        raise ValueError(f"{num_tokens} tokens need {-(-num_tokens // block_size)} blocks, "
                         f"the block table has {len(block_table)}")
    return [block_table[t // block_size] * block_size + t % block_size for t in range(num_tokens)]


def render_slots_text(block_tables: Mapping[str, Sequence[int]], context_lens: Mapping[str, int],
                      block_size: int) -> str:
    """One line per token: position, logical block, offset, physical block, slot."""
    lines = ["seq    token  logical  offset  block  slot"]
    for name, table in block_tables.items():
        for t, slot in enumerate(token_slots(table, block_size, context_lens[name])):
            lines.append(f"{name:<6} {t:>5}  {t // block_size:>7}  {t % block_size:>6}  "
                         f"{table[t // block_size]:>5}  {slot:>4}")
    return "\n".join(lines)


def draw_slots(block_tables: Mapping[str, Sequence[int]], context_lens: Mapping[str, int],
               num_blocks: int, block_size: int, *, highlight: Iterable[int] = (),
               title: str = "") -> Figure:
    """Logical blocks of each sequence (left) mapped onto physical slots (right).

    A pool cell shows its slot number and, when a sequence's token lives there, ``name:t``
    in that sequence's colour. Slots in ``highlight`` (e.g. just written by
    ``store_kvcache``) get a thick border. Returns a ``matplotlib.figure.Figure``.
    """
    owner: dict[int, tuple[int, str]] = {}            # slot -> (sequence index, label)
    for i, (name, table) in enumerate(block_tables.items()):
        for t, slot in enumerate(token_slots(table, block_size, context_lens[name])):
            owner[slot] = (i, f"{name}:{t}")
    highlight = set(highlight)

    logical_w, gap, label_w = 2.6, 2.4, 1.6
    pool_x = logical_w + gap + label_w
    rows = max(num_blocks, sum(len(t) for t in block_tables.values()) + len(block_tables))
    width = pool_x + block_size * 1.2 + 0.2
    top = 2.2 if title else 1.2
    fig = Figure(figsize=(width * INCH_PER_UNIT, (rows + top + 0.2) * INCH_PER_UNIT * 0.8))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-0.1, width)
    ax.set_ylim(rows + 0.2, -top)
    ax.set_axis_off()
    if title:
        ax.text(0, -1.6, title, fontsize=12, va="center")
    ax.text(0, -0.6, "logical blocks", fontsize=10, weight="bold", va="center")
    ax.text(pool_x, -0.6, "physical slots", fontsize=10, weight="bold", va="center")

    # physical pool: one row per block, one cell per slot
    for b in range(num_blocks):
        ax.text(pool_x - 0.2, b + 0.4, f"block {b}", ha="right", va="center", fontsize=9)
        for off in range(block_size):
            slot = b * block_size + off
            x = pool_x + off * 1.2
            seq_i, label = owner.get(slot, (None, ""))
            color = SEQ_COLORS[seq_i % len(SEQ_COLORS)] if seq_i is not None else None
            ax.add_patch(Rectangle((x, b), 1.1, 0.8, facecolor=color or "white",
                                   alpha=0.25 if color else 1.0, edgecolor="none"))
            ax.add_patch(Rectangle((x, b), 1.1, 0.8, fill=False, edgecolor="black" if slot in highlight else EDGE,
                                   linewidth=2.8 if slot in highlight else 0.8))
            ax.text(x + 0.06, b + 0.2, str(slot), fontsize=7, color="#666666", va="center")
            if label:
                ax.text(x + 0.55, b + 0.55, label, fontsize=8, ha="center", va="center",
                        color=color, weight="bold")

    # logical side: each sequence's blocks stacked, with an arrow to its physical block
    y = 0.0
    for i, (name, table) in enumerate(block_tables.items()):
        color = SEQ_COLORS[i % len(SEQ_COLORS)]
        n_tok = context_lens[name]
        ax.text(0, y + 0.4, f"seq {name}", fontsize=10, weight="bold", color=color, va="center")
        y += 1
        for lb, pb in enumerate(table):
            first, last = lb * block_size, min(n_tok, (lb + 1) * block_size) - 1
            tokens = f"t{first}" if first == last else f"t{first}-{last}" if first < last else "empty"
            ax.add_patch(Rectangle((0.2, y), logical_w - 0.2, 0.8, facecolor=color, alpha=0.25,
                                   edgecolor=EDGE))
            ax.text(0.3, y + 0.4, f"L{lb}: {tokens}", fontsize=9, va="center")
            ax.add_patch(FancyArrowPatch((logical_w, y + 0.4), (pool_x - label_w - 0.05, pb + 0.4),
                                         arrowstyle="-|>", mutation_scale=12, color=color,
                                         linewidth=1.4))
            y += 1
    return fig


def show_slots(block_tables: Mapping[str, Sequence[int]], context_lens: Mapping[str, int],
               num_blocks: int, block_size: int, *, highlight: Iterable[int] = (),
               title: str = "", text: bool = True) -> None:
    """Print the slot table (unless ``text`` is False) and display the drawing."""
    from IPython.display import Image, display

    from course_pkg.viz.draw import figure_png

    if text:
        print(render_slots_text(block_tables, context_lens, block_size))
    display(Image(data=figure_png(draw_slots(block_tables, context_lens, num_blocks, block_size,
                                             highlight=highlight, title=title)), format="png"))
