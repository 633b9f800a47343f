"""A correct solution of lab `sliding_window`, written from the chapter's explanation, not from the
package's code: the window's first position as a range, a forward scan that collects the blocks to
give back before releasing them newest first, and a hit found by trying every length from the longest.

Grade it like a student's file: ``python -m course_pkg.labs sliding_window tests/lab_solutions/sliding_window.py``.
"""
from __future__ import annotations

from course_pkg.hybrid_block_manager import NULL_BLOCK, SlidingWindowManager


class StudentSlidingWindowManager(SlidingWindowManager):
    def first_needed_block(self, num_computed_tokens):
        w = self.sliding_window
        if w is None:
            return 0
        first_position_read = num_computed_tokens + 1 - w
        if first_position_read <= 0:
            return 0
        return first_position_read // self.block_size

    def remove_skipped_blocks(self, seq):
        table = self.table(seq)
        end = min(self.first_needed_block(seq.num_cached_tokens), len(table))
        skipped = [i for i in range(end) if table[i] != NULL_BLOCK]
        skipped.reverse()                       # the newest first: the oldest reaches the tail last
        freed = []
        for i in skipped:
            freed.append(table[i])
            self._release(table[i])
            table[i] = NULL_BLOCK
        return freed

    def longest_hit(self, seq, num_blocks, cached, ids):
        lengths = sorted(range(1, num_blocks + 1), reverse=True)
        for length in lengths:
            if ids[length - 1] is None:
                continue
            window = range(self.first_needed_block(length * self.block_size), length)
            if not any(cached[i] == NULL_BLOCK for i in window):
                return length
        return 0
