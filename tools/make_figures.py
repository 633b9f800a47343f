"""Regenerate figures/*.png from the package (`make figures`).

Every figure replays a small, fixed run of the real BlockManager through a Recorder and
draws the recorded snapshots, so the pictures always show what the code does. The output
is deterministic: the same code writes the same bytes (no timestamps in the PNGs).

    python tools/make_figures.py [--out figures]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from course_pkg import BlockManager, Sequence
from course_pkg.viz import Recorder, draw_snapshot, draw_steps, figure_png

DPI = 110


def shared_prefix_run() -> Recorder:
    """Chapter 02's run: A and B share a two-block prefix, A decodes, both leave, C revives it."""
    rec = Recorder(BlockManager(num_blocks=8, block_size=4))
    bm = rec.watch()
    rec.record("start")
    a = rec.name(Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], block_size=4), "A")
    b = rec.name(Sequence([1, 2, 3, 4, 5, 6, 7, 8, 50, 51, 52], block_size=4), "B")
    bm.allocate(a, bm.can_allocate(a))
    a.num_cached_tokens = len(a)          # A's prefill computed its prompt
    bm.hash_blocks(a)
    bm.allocate(b, bm.can_allocate(b))
    for token in (11, 12, 13):
        a.append_token(token)
        bm.may_append(a)
    bm.deallocate(b)
    bm.deallocate(a)
    c = rec.name(Sequence([1, 2, 3, 4, 5, 6, 7, 8, 60], block_size=4), "C")
    bm.allocate(c, bm.can_allocate(c))
    return rec


def four_states_run() -> Recorder:
    """Every block state at once: C registers a block and leaves, then A and B share a prefix."""
    rec = Recorder(BlockManager(num_blocks=8, block_size=4))
    bm = rec.watch()
    c = rec.name(Sequence([7, 7, 7, 7, 9], block_size=4), "C")
    bm.allocate(c, 0)
    c.num_cached_tokens = len(c)
    bm.hash_blocks(c)
    bm.deallocate(c)
    a = rec.name(Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], block_size=4), "A")
    b = rec.name(Sequence([1, 2, 3, 4, 5, 6, 7, 8, 50, 51, 52], block_size=4), "B")
    bm.allocate(a, bm.can_allocate(a))
    a.num_cached_tokens = len(a)
    bm.hash_blocks(a)
    bm.allocate(b, bm.can_allocate(b))
    return rec


def figures() -> dict[str, bytes]:
    out = {}
    state = four_states_run().snapshots[-1]
    out["block_manager_state.png"] = figure_png(
        draw_snapshot(state, title="A and B share a 2-block prefix (allocate(B, 2))"), dpi=DPI)

    run = shared_prefix_run()
    # The calls that change the state (queries leave it as it was).
    changing = [s for s in run.snapshots if not s.label.startswith(("can_allocate", "can_append"))]
    wanted = ["start", "allocate(A, 0)", "hash_blocks(A)", "allocate(B, 2)", "may_append(A)",
              "deallocate(B)", "deallocate(A)", "allocate(C, 2)"]
    # The last snapshot with each label: A's third may_append is the one that takes a block.
    steps = [next(s for s in reversed(changing) if s.label == label) for label in wanted]
    out["block_manager_steps.png"] = figure_png(
        draw_steps(steps, ncols=1, title="Admission, sharing, append, release and revival, step by step"), dpi=80)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "figures"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, png in figures().items():
        (out / name).write_bytes(png)
        print(f"wrote {out.name}/{name} ({len(png) // 1024} KiB)")


if __name__ == "__main__":
    main()
