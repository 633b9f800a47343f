"""Show a radix tree of cached blocks: as text (checked by nbval) and as a figure (chapter 11).

Both compress a chain of nodes that each have one child into one edge, as SGLang stores it: a
document shared by many requests is then one long edge with the requests' own blocks as short
branches below it. The text names each edge by its first and last key, its length in blocks,
its holders and the last use of its deepest node; the figure draws depth in blocks downwards.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from matplotlib.figure import Figure

from course_pkg.radix_tree import RadixCache, RadixNode


def _chain(node: RadixNode) -> list[RadixNode]:
    """``node`` and its descendants while each has exactly one child (one compressed edge)."""
    chain = [node]
    while len(chain[-1].children) == 1:
        chain.append(next(iter(chain[-1].children.values())))
    return chain


def render_tree(cache: RadixCache, max_lines: int = 40) -> str:
    """One line per compressed edge, depth first: ``keys first..last (n blocks) held h, used t``."""
    lines: list[str] = [f"radix tree: {cache.num_cached} of {cache.num_blocks} blocks cached, "
                        f"{cache.evictable} evictable"]

    def visit(node: RadixNode, indent: str) -> None:
        children = list(node.children.values())
        for k, child in enumerate(children):
            chain = _chain(child)
            last = chain[-1]
            keys = f"{chain[0].key}" if len(chain) == 1 else f"{chain[0].key}..{last.key}"
            branch = "└─ " if k == len(children) - 1 else "├─ "
            lines.append(f"{indent}{branch}{keys} ({len(chain)} block{'s' if len(chain) > 1 else ''}) "
                         f"held {last.ref_count}, used {last.last_access}")
            visit(last, indent + ("   " if k == len(children) - 1 else "│  "))

    visit(cache.root, "")
    if len(lines) > max_lines:
        lines = lines[:max_lines - 1] + [f"... {len(lines) - max_lines + 1} more edges"]
    return "\n".join(lines)


def tree_of(paths: Iterable[Sequence[Hashable]]) -> RadixCache:
    """A radix tree holding every path, with room for all of them (nothing evicted)."""
    paths = [tuple(p) for p in paths]
    cache = RadixCache(max(1, sum(len(p) for p in paths)))
    for p in paths:
        cache.tick()
        cache.insert(p)
    return cache


def draw_tree(cache: RadixCache, ax, title: str = "") -> None:
    """Compressed edges as lines, depth in blocks downwards, leaves spread left to right."""
    x_of: dict[int, float] = {}
    leaves = 0

    def place(node: RadixNode) -> float:
        nonlocal leaves
        last = _chain(node)[-1] if node is not cache.root else node
        if not last.children:
            x = float(leaves)
            leaves += 1
        else:
            xs = [place(child) for child in last.children.values()]
            x = sum(xs) / len(xs)
        x_of[id(node)] = x
        return x

    place(cache.root)

    def draw(node: RadixNode, x0: float, depth0: int) -> None:
        last = _chain(node)[-1] if node is not cache.root else node
        for child in last.children.values():
            chain = _chain(child)
            x1, depth1 = x_of[id(child)], chain[-1].depth
            ax.plot([x0, x1], [depth0, chain[0].depth], color="#999999", lw=0.8)
            ax.plot([x1, x1], [chain[0].depth, depth1], color="#1f5fa8", lw=2.2 if len(chain) > 1 else 1.2)
            ax.plot([x1], [depth1], "o", ms=3, color="#c0392b" if not chain[-1].children else "#1f5fa8")
            draw(child, x1, depth1)

    draw(cache.root, x_of[id(cache.root)], 0)
    ax.invert_yaxis()
    ax.set_ylabel("depth (blocks of 512 tokens)")
    ax.set_xticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    if title:
        ax.set_title(title, fontsize=10)


def tree_figure(trees: dict[str, RadixCache], width: float = 11, height: float = 3.6) -> Figure:
    """One panel per tree, side by side."""
    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(1, len(trees), squeeze=False)[0]
    for ax, (title, cache) in zip(axes, trees.items()):
        draw_tree(cache, ax, title)
    return fig
