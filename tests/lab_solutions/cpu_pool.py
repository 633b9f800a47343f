"""A correct solution of lab `cpu_pool`, written from the chapter's explanation, not from the package's code.

It hands out the most recently freed CPU blocks first (a stack, not the package's FIFO): CPU blocks
hold no cache, so the order does not matter, and the grader accepts it (this test is what
holds the lab to that: tests/test_labs.py grades this file).

Grade it like a student's file: ``python -m course_pkg.labs cpu_pool tests/lab_solutions/cpu_pool.py``.
"""
from __future__ import annotations

from course_pkg.swap import CpuBlockPool


class StudentCpuBlockPool(CpuBlockPool):
    def can_swap_out(self, num_blocks):
        return len(self.free_block_ids) - num_blocks >= 0

    def swap_out(self, seq_id, num_blocks, num_computed_tokens):
        if seq_id in self.swapped:
            raise ValueError(f"sequence {seq_id} is swapped out already")
        if not self.can_swap_out(num_blocks):
            raise ValueError(f"sequence {seq_id}: {num_blocks} CPU blocks needed, {len(self.free_block_ids)} free")
        taken = [self.free_block_ids.pop() for _ in range(num_blocks)]
        self.swapped[seq_id] = (taken, num_computed_tokens)
        return taken

    def release(self, seq_id):
        taken, _ = self.swapped.pop(seq_id)
        self.free_block_ids.extend(reversed(taken))
