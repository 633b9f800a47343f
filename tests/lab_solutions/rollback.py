"""A correct solution of lab `rollback`, written from the chapter's explanation, not from the package's code.

Grade it like a student's file: ``python -m course_pkg.labs rollback tests/lab_solutions/rollback.py``.
"""
from __future__ import annotations

from course_pkg.block_manager import BlockManager


class PopWhileRollbackBlockManager(BlockManager):
    """Pops blocks off the end of the table while more are held than the verified tokens need,
    each to the head of the free queue (the last one first, so the first taken ends at the head)."""

    def free_lookahead_slots(self, seq):
        needed = (seq.num_cached_tokens + self.block_size - 1) // self.block_size
        freed = []
        while len(seq.block_table) > needed:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            self._release_to_head(block)
            freed.insert(0, block.block_id)
        return freed


StudentRollbackBlockManager = PopWhileRollbackBlockManager
