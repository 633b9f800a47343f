"""Shared test helpers: a full copy of a BlockManager's state, and its invariants."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from course_pkg import BlockManager, Sequence


def state(bm: BlockManager, seqs=()) -> tuple:
    """Everything observable about the manager (and the sequences' bookkeeping), by value."""
    return (
        tuple((b.block_id, b.ref_count, b.hash, tuple(b.token_ids)) for b in bm.blocks),
        tuple(bm.free_block_ids),
        frozenset(bm.used_block_ids),
        tuple(sorted(bm.hash_to_block_id.items())),
        tuple((s.seq_id, tuple(s.block_table), tuple(s.block_hashes), s.num_cached_tokens, s.num_tokens)
              for s in seqs),
    )


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    n = len(bm.blocks)
    free = list(bm.free_block_ids)
    assert len(free) == len(set(free)), "a block is twice in the free queue"
    assert set(free).isdisjoint(bm.used_block_ids), "a block is both free and used"
    assert set(free) | bm.used_block_ids == set(range(n)), "free and used do not cover the pool"
    for b in bm.blocks:
        assert (b.ref_count == 0) == (b.block_id in set(free)), f"block {b.block_id}: ref {b.ref_count} vs free queue"
        assert b.ref_count >= 0
    entries = sum(len(s.block_table) for s in live)
    assert sum(b.ref_count for b in bm.blocks) == entries, "ref counts do not sum to block-table entries"
    for s in live:
        counts = {}
        for bid in s.block_table:
            counts[bid] = counts.get(bid, 0) + 1
        assert all(c == 1 for c in counts.values()), "a sequence holds the same block twice"
        assert len(s.block_table) == s.num_blocks
    for h, bid in bm.hash_to_block_id.items():
        block = bm.blocks[bid]
        assert block.hash == h, f"index entry {h} -> {bid} but block {bid} has hash {block.hash}"
        assert len(block.token_ids) == bm.block_size


def load_build_slides():
    """tools/build_slides.py as a module (tools/ is not a package)."""
    path = Path(__file__).resolve().parents[1] / "tools" / "build_slides.py"
    spec = importlib.util.spec_from_file_location("build_slides", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("build_slides", module)
    spec.loader.exec_module(module)
    return module
