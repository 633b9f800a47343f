"""A correct solution of lab `stale_entry_guard`, written from the chapter's explanation, not from the package's code.

Grade it like a student's file: ``python -m course_pkg.labs stale_entry_guard tests/lab_solutions/stale_entry_guard.py``.
"""
from __future__ import annotations

from course_pkg.block_manager import BlockManager


class StudentGuardBlockManager(BlockManager):
    """Drops the entry only while it still names this block (a newer block may own the hash)."""

    def _maybe_evict_cached_block(self, block):
        owner = self.hash_to_block_id.get(block.hash)
        if owner is not None and owner == block.block_id:
            self.hash_to_block_id.pop(block.hash)
