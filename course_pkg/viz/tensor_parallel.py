"""A drawing of one forward pass split over the ranks: where each rank computes alone, and
where the ranks meet in an all-reduce or a gather."""
from __future__ import annotations


def draw_tensor_parallel_step(config, world_size: int = 2):
    """A matplotlib ``Figure``: one column per rank, one row per stage of the forward pass.

    Boxes are local work (with this rank's share, computed from ``config``); the bands across
    all columns are the collectives -- an all-reduce adds the ranks' partial results and gives
    every rank the sum; the gather collects the logits' vocabulary slices on rank 0.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    k = world_size
    q, kv = config.num_attention_heads // k, config.num_key_value_heads // k
    inter, vocab, h = config.intermediate_size // k, config.vocab_size // k, config.hidden_size

    def local(r):
        return [
            ("broadcast", "rank 0 -> all: token ids, positions, slot mapping, block tables, ..."),
            f"embedding rows [{r * vocab}, {(r + 1) * vocab})\nids outside -> zeros",
            ("all-reduce", f"[tokens, {h}]: the embeddings"),
            f"q heads [{r * q}, {(r + 1) * q}), KV heads [{r * kv}, {(r + 1) * kv})\n"
            f"store K/V in this rank's cache (same slots),\nattend over it (same block table)",
            f"o_proj: columns [{r * q * config.head_dim}, {(r + 1) * q * config.head_dim})\n-> a partial sum",
            ("all-reduce", f"[tokens, {h}]: attention output"),
            f"gate, up: features [{r * inter}, {(r + 1) * inter})\nSwiGLU; down_proj -> a partial sum",
            ("all-reduce", f"[tokens, {h}]: MLP output"),
            f"LM head: logits of vocabulary\n[{r * vocab}, {(r + 1) * vocab})",
            ("gather", f"[rows, {vocab}] per rank -> [rows, {config.vocab_size}] on rank 0"),
        ]

    stages = local(0)
    fig = Figure(figsize=(4.2 * k + 1.0, 9.6))
    fig.subplots_adjust(left=0.01, right=0.99, top=0.95, bottom=0.01)
    ax = fig.add_subplot()
    ax.set_xlim(0, 4.2 * k + 1.0)
    ax.set_ylim(-0.9, len(stages) + 0.7)
    ax.axis("off")
    ax.set_title(f"One step on {k} ranks", fontsize=11)
    first, last = len(stages) - 1 - 3, len(stages) - 1 - 7      # the rows of one decoder layer
    ax.plot([4.2 * k + 0.15] * 2, [last + 0.1, first + 0.8], color="#333", lw=1.5)
    ax.text(4.2 * k + 0.25, (first + last) / 2 + 0.45, f"x {config.num_hidden_layers}\nlayers", fontsize=9,
            va="center")
    for r in range(k):
        ax.text(0.3 + 4.2 * r + 1.8, len(stages) + 0.25, f"rank {r}" + (" (engine, scheduler, sampler)" if r == 0
                else " (worker process)"), ha="center", fontsize=10, weight="bold")
    for i in range(len(stages)):
        y = len(stages) - 1 - i
        for r in range(k):
            stage = local(r)[i]
            x = 0.3 + 4.2 * r
            if isinstance(stage, tuple):
                if r == 0:
                    kind, text = stage
                    colour = {"all-reduce": "#f4a261", "gather": "#9b5de5", "broadcast": "#2a9d8f"}[kind]
                    ax.add_patch(FancyBboxPatch((0.3, y + 0.2), 4.2 * k - 0.6, 0.45, boxstyle="round,pad=0.02",
                                                fc=colour, ec="none", alpha=0.85))
                    ax.text(2.1 * k, y + 0.42, f"{kind}  {text}", ha="center", va="center", fontsize=9,
                            color="white", weight="bold")
            else:
                ax.add_patch(FancyBboxPatch((x, y + 0.05), 3.6, 0.75, boxstyle="round,pad=0.02",
                                            fc="#e9f5fb", ec="#457b9d"))
                ax.text(x + 1.8, y + 0.43, stage, ha="center", va="center", fontsize=8)
            if i:
                ax.add_patch(FancyArrowPatch((x + 1.8, y + 1.05), (x + 1.8, y + 0.85), arrowstyle="-|>",
                                             mutation_scale=10, color="#555"))
    ax.add_patch(FancyBboxPatch((0.3, -0.8), 3.6, 0.6, boxstyle="round,pad=0.02", fc="#d8f3dc", ec="#2d6a4f"))
    ax.text(2.1, -0.5, "sampler: one token per sequence", ha="center", va="center", fontsize=8)
    ax.add_patch(FancyArrowPatch((2.1, 0.15), (2.1, -0.15), arrowstyle="-|>", mutation_scale=10, color="#555"))
    return fig
