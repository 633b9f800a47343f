"""Both block pools at once, device and CPU, for preemption by swapping (chapter 09).

A cell holds the names of the sequences whose blocks it stores (several names: a shared
prefix block), or nothing when it is free. The state after each step is kept as plain tuples,
rendered as text (deterministic) and drawn as two strips per step.
"""
from __future__ import annotations

from matplotlib.figure import Figure


def pool_owners(block_manager, cpu_pool, seqs: dict[str, object]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(device, cpu)``: per block, the names of the sequences holding it ("" = free)."""
    device = [""] * block_manager.num_blocks
    cpu = [""] * cpu_pool.num_blocks
    for name, seq in seqs.items():
        for b in seq.block_table:
            device[b] += name
        if seq.seq_id in cpu_pool:
            for b in cpu_pool.block_table(seq.seq_id):
                cpu[b] += name
    return tuple(device), tuple(cpu)


def render_pools(device: tuple[str, ...], cpu: tuple[str, ...]) -> str:
    width = max([1] + [len(c) for c in device + cpu])

    def strip(cells):
        return "|" + "|".join(f"{c or '.':^{width}}" for c in cells) + "|"

    return f"device {strip(device)}\ncpu    {strip(cpu)}"


def draw_pools(states: list[tuple[tuple[str, ...], tuple[str, ...]]], labels: list[str]) -> Figure:
    """One row per step: the device pool, then the CPU pool, coloured by owner."""
    import matplotlib

    names = sorted({c for device, cpu in states for c in device + cpu if c})
    palette = matplotlib.colormaps["tab10"]
    color = {name: palette(i % 10) for i, name in enumerate(names)}
    num_device, num_cpu = len(states[0][0]), len(states[0][1])
    fig = Figure(figsize=(0.42 * (num_device + num_cpu) + 3.5, 0.5 * len(states) + 0.8), layout="constrained")
    ax = fig.subplots()
    for row, (device, cpu) in enumerate(states):
        y = len(states) - 1 - row
        for x0, cells in ((0, device), (num_device + 1.5, cpu)):
            for i, owner in enumerate(cells):
                ax.add_patch(matplotlib.patches.Rectangle((x0 + i, y + 0.1), 0.92, 0.8, edgecolor="0.5",
                                                          facecolor=color.get(owner, "white") if owner else "white"))
                if owner:
                    ax.text(x0 + i + 0.46, y + 0.5, owner, ha="center", va="center", fontsize=8)
        ax.text(-0.4, y + 0.5, labels[row], ha="right", va="center", fontsize=8)
    top = len(states) + 0.2
    ax.text(num_device / 2, top, "device blocks", ha="center", fontsize=9)
    ax.text(num_device + 1.5 + num_cpu / 2, top, "CPU blocks", ha="center", fontsize=9)
    ax.set_xlim(-0.5, num_device + num_cpu + 2)
    ax.set_ylim(0, len(states) + 0.7)
    ax.axis("off")
    return fig
