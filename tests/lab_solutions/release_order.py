"""A correct solution of lab `release_order`, written from the chapter's explanation, not from the package's code.

Grade it like a student's file: ``python -m course_pkg.labs release_order tests/lab_solutions/release_order.py``.
"""
from __future__ import annotations

from course_pkg.block_manager import BlockManager


class StudentReleaseBlockManager(BlockManager):
    """Releases from the last block to the first, by index."""

    def deallocate(self, seq):
        if not seq.block_table:
            raise ValueError("the sequence holds no blocks")
        for i in range(len(seq.block_table) - 1, -1, -1):
            block = self.blocks[seq.block_table[i]]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.discard(block.block_id)
                self.free_block_ids.append(block.block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_cached_tokens = 0
