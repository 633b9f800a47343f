"""The device pool and the tier behind it, after every step (chapter 15).

A cell shows *what* a block holds -- ``A1`` is block 1 of prompt A -- so a block can be followed
from the device, into the tier, out of the device, and back: computed, registered, stored,
evicted from the device, found in the tier, loaded. ``block_labels`` names the full blocks of the
prompts a notebook runs, by their chained hash (as the BlockManager computes it); a block held
but not registered yet shows as ``*``. The tier's own order is shown too: its LRU list, or ARC's
T1/T2 and the ghosts B1/B2. Text (deterministic, for nbval) and a figure, from one frozen
snapshot per step.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from matplotlib.figure import Figure

from course_pkg.block_manager import BlockManager


def block_labels(prompts: Mapping[str, Sequence[int]], block_size: int) -> dict[int, str]:
    """``{chained hash: "A0", ...}`` for every full block of each named prompt (no salt); a block
    two prompts share keeps the first name."""
    labels: dict[int, str] = {}
    for name, tokens in prompts.items():
        h = -1
        for i in range(len(tokens) // block_size):
            h = BlockManager.compute_hash(list(tokens[i * block_size:(i + 1) * block_size]), h)
            labels.setdefault(h, f"{name}{i}")
    return labels


@dataclass(frozen=True)
class TierSnapshot:
    label: str
    device: tuple[tuple[str, str], ...]   # per device block: (what it holds, "free" | "cached" | "held")
    tier: tuple[tuple[str, str], ...]     # per tier slot: (what it holds, "free" | "storing" | "ready")
    lists: tuple[tuple[str, tuple[str, ...]], ...]   # the tier's order, oldest first: LRU, or T1 T2 B1 B2
    stored: tuple[str, ...]               # blocks copied into the tier in this step
    loaded: tuple[str, ...]               # blocks copied from the tier into the device in this step
    free_queue: tuple[int, ...] = ()      # the device's free queue, head (handed out next) first


def take_tier_snapshot(llm, labels: Mapping[int, str], label: str = "") -> TierSnapshot:
    """The device pool, the tier and the last step's tier copies of ``llm`` (an engine with a
    ``kv_transfer_config``), each block named by ``labels`` (``block_labels``)."""
    bm, off = llm.block_manager, llm.scheduler.offload
    manager = getattr(off.manager, "backing", off.manager)
    name = lambda h: labels.get(h, "?")   # noqa: E731 -- a block of no named prompt
    device = []
    for b in bm.blocks:
        what = name(b.hash) if b.hash != -1 else ("*" if b.ref_count else "")
        state = "held" if b.ref_count else ("cached" if b.hash != -1 and bm.hash_to_block_id.get(b.hash) == b.block_id
                                            else "free")
        device.append((what if state != "free" else "", state))
    if hasattr(manager, "blocks"):
        held, lists = dict(manager.blocks.items()), (("LRU", tuple(map(name, manager.blocks))),)
    else:
        held = {**dict(manager.t1.items()), **dict(manager.t2.items())}
        lists = tuple((n, tuple(map(name, getattr(manager, n.lower())))) for n in ("T1", "T2", "B1", "B2"))
    tier = [("", "free")] * manager.num_blocks
    for h, block in held.items():
        tier[block.block_id] = (name(h), "ready" if block.is_ready else "storing")
    step = llm.last_step
    stored = tuple(tier[slot][0] for _, slot in step.store) if step else ()
    loaded = tuple(device[dst][0] for _, dst in step.load) if step else ()
    return TierSnapshot(label, tuple(device), tuple(tier), lists, stored, loaded, tuple(bm.free_block_ids))


def render_tier(snap: TierSnapshot) -> str:
    """Deterministic text: the two pools as strips (``.`` free, ``~`` a cached block still in the
    device's index, ``+`` a tier block still being stored), the device's free queue (block id, and
    what a cached one holds), the tier's lists, the step's copies."""
    width = max([2] + [len(w) + 1 for w, _ in snap.device + snap.tier])

    def cell(what, state):
        mark = {"cached": "~", "storing": "+"}.get(state, "")
        return f"{(what + mark) or '.':^{width}}"

    lines = [f"== {snap.label}"] if snap.label else []
    lines.append("device |" + "|".join(cell(*c) for c in snap.device) + "|")
    lines.append("tier   |" + "|".join(cell(*c) for c in snap.tier) + "|")
    lines.append("free queue (head first): " + " ".join(
        f"{b}:{snap.device[b][0]}" if snap.device[b][0] else str(b) for b in snap.free_queue))
    lines.append("  ".join(f"{n}: {' '.join(items) or '-'}" for n, items in snap.lists))
    if snap.stored or snap.loaded:
        lines.append(f"this step: stored {' '.join(snap.stored) or '-'}; loaded {' '.join(snap.loaded) or '-'}")
    return "\n".join(lines)


def draw_tier_steps(snaps: Sequence[TierSnapshot]) -> Figure:
    """One row per step: the device pool, then the tier, each cell coloured by the prompt its
    block belongs to; hatched: cached but free (device) or still being stored (tier); a thick
    edge: copied in this step (stored into the tier, or loaded into the device)."""
    import matplotlib

    prompts = sorted({w[0] for s in snaps for w, _ in s.device + s.tier if w and w[0].isalpha()})
    palette = matplotlib.colormaps["tab10"]
    color = {p: palette(i % 10) for i, p in enumerate(prompts)}
    num_device, num_tier = len(snaps[0].device), len(snaps[0].tier)
    fig = Figure(figsize=(0.45 * (num_device + num_tier) + 3.0, 0.55 * len(snaps) + 0.9), layout="constrained")
    ax = fig.subplots()
    for row, snap in enumerate(snaps):
        y = len(snaps) - 1 - row
        for x0, cells, moved in ((0, snap.device, set(snap.loaded)), (num_device + 1.5, snap.tier, set(snap.stored))):
            for i, (what, state) in enumerate(cells):
                face = color.get(what[:1], "0.85") if what else "white"
                ax.add_patch(matplotlib.patches.Rectangle(
                    (x0 + i, y + 0.1), 0.92, 0.8, facecolor=face, alpha=0.45 if state in ("cached", "storing") else 0.9,
                    hatch="//" if state in ("cached", "storing") else None, edgecolor="black" if what in moved else "0.5",
                    linewidth=2.2 if what in moved and what else 0.8))
                if what:
                    ax.text(x0 + i + 0.46, y + 0.5, what, ha="center", va="center", fontsize=7)
        ax.text(-0.4, y + 0.5, snap.label, ha="right", va="center", fontsize=8)
    top = len(snaps) + 0.2
    ax.text(num_device / 2, top, "device blocks", ha="center", fontsize=9)
    ax.text(num_device + 1.5 + num_tier / 2, top, "tier slots (CPU)", ha="center", fontsize=9)
    ax.set_xlim(-0.5, num_device + num_tier + 2)
    ax.set_ylim(0, len(snaps) + 0.7)
    ax.axis("off")
    return fig
