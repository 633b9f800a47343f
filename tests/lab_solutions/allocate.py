"""A correct solution of lab `allocate`, written from the chapter's explanation, not from the package's code.

Grade it like a student's file: ``python -m course_pkg.labs allocate tests/lab_solutions/allocate.py``.
"""
from __future__ import annotations

from course_pkg.block_manager import BlockManager, NoFreeBlocksError


class ScratchAllocateBlockManager(BlockManager):
    """allocate and deallocate written from the chapter's contract, not from the package's code."""

    def allocate(self, seq, num_cached_blocks=0):
        if seq.block_table:
            raise ValueError("the sequence already has blocks")
        hits, hashes = self._match_prefix(seq)
        if not 0 <= num_cached_blocks <= len(hits):
            raise ValueError("more cached blocks than the cache holds")
        hits = hits[:num_cached_blocks]
        revived = [b for b in hits if self.blocks[b].ref_count == 0]
        if seq.num_blocks - len(hits) + len(revived) > len(self.free_block_ids):
            raise NoFreeBlocksError("too few free blocks")
        for b in hits:
            if b in revived:
                self.free_block_ids.remove(b)
                self.used_block_ids.add(b)
            self.blocks[b].ref_count += 1
            seq.block_table.append(b)
        while len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._allocate_block().block_id)
        seq.block_hashes = hashes[:num_cached_blocks]
        seq.num_cached_tokens = num_cached_blocks * self.block_size
        self.prefix_cache_stats.record(seq.num_tokens, seq.num_cached_tokens, preempted=bool(seq.num_preemptions))

    def deallocate(self, seq):
        if not seq.block_table:
            raise ValueError("the sequence holds no blocks")
        for b in seq.block_table[::-1]:
            block = self.blocks[b]
            block.ref_count -= 1
            if not block.ref_count:
                self.used_block_ids.discard(b)
                self.free_block_ids.append(b)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_cached_tokens = 0


StudentAllocateBlockManager = ScratchAllocateBlockManager
