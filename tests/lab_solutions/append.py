"""A correct solution of lab `append`, written from the chapter's explanation, not from the package's code.

Grade it like a student's file: ``python -m course_pkg.labs append tests/lab_solutions/append.py``.
"""
from __future__ import annotations

from course_pkg.block_manager import BlockManager, NoFreeBlocksError


class MinusOneRuleBlockManager(BlockManager):
    """can_append / may_append by the rule "(len - 1) % block_size == 0" instead of counting the table."""

    def can_append(self, seq):
        return len(self.free_block_ids) >= ((len(seq) - 1) % self.block_size == 0)

    def may_append(self, seq):
        if (len(seq) - 1) % self.block_size == 0:
            if not self.free_block_ids:
                raise NoFreeBlocksError("no free block")
            seq.block_table.append(self._allocate_block().block_id)


StudentAppendBlockManager = MinusOneRuleBlockManager
