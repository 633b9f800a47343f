"""A correct solution of lab `fork_cow`, written from the chapter's explanation, not from the package's code.

Grade it like a student's file: ``python -m course_pkg.labs fork_cow tests/lab_solutions/fork_cow.py``.
"""
from __future__ import annotations

from course_pkg.block_manager import BlockManager, NoFreeBlocksError


class ScratchForkBlockManager(BlockManager):
    """fork and copy-on-write written from chapter 08's rules."""

    def fork(self, parent, child):
        if (not parent.block_table or child.block_table or child.token_ids != parent.token_ids
                or child.num_cached_tokens != parent.num_cached_tokens):
            raise ValueError("fork needs a parent with blocks and a blockless copy of it")
        for b in parent.block_table:
            self.blocks[b].ref_count += 1
        child.block_table = parent.block_table.copy()
        child.block_hashes = parent.block_hashes.copy()

    def may_append(self, seq):
        last = self.blocks[seq.block_table[-1]]
        shared_partial = len(seq.block_table) == seq.num_blocks and last.ref_count > 1
        if not shared_partial and len(seq.block_table) == seq.num_blocks:
            return []
        if not self.free_block_ids:
            raise NoFreeBlocksError("no free block")
        fresh = self._allocate_block()
        if shared_partial:
            last.ref_count -= 1
            seq.block_table[-1] = fresh.block_id
            return [(last.block_id, fresh.block_id)]
        seq.block_table.append(fresh.block_id)
        return []


StudentForkBlockManager = ScratchForkBlockManager
