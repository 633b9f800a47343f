"""A correct solution of lab `logical_blocks`, written from the chapter's explanation, not from the package's code.

Grade it like a student's file: ``python -m course_pkg.labs logical_blocks tests/lab_solutions/logical_blocks.py``.
"""
from __future__ import annotations

from course_pkg.sequence import Sequence


class ArithmeticSequence(Sequence):
    @property
    def num_blocks(self):
        return -(-self.num_tokens // self.block_size)

    @property
    def last_block_num_tokens(self):
        return (self.num_tokens - 1) % self.block_size + 1

    def block(self, i):
        if not 0 <= i < self.num_blocks:
            raise IndexError(i)
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]


StudentSequence = ArithmeticSequence
