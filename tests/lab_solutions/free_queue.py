"""A correct solution of lab `free_queue`, written from the chapter's explanation, not from the package's code.

Grade it like a student's file: ``python -m course_pkg.labs free_queue tests/lab_solutions/free_queue.py``.
"""
from __future__ import annotations


class DictFreeBlockQueue:
    """A linked free queue written with dicts, differently from the package's arrays."""

    def __init__(self, num_blocks):
        self.n = num_blocks
        self.prev, self.next = {}, {}
        self.first = self.last = None
        for b in range(num_blocks):
            self.append(b)

    def __len__(self):
        return len(self.prev)

    def __iter__(self):
        b = self.first
        while b is not None:
            yield b
            b = self.next[b]

    def popleft(self):
        if self.first is None:
            raise IndexError("empty")
        b = self.first
        self.remove(b)
        return b

    def append(self, b):
        if not (isinstance(b, int) and 0 <= b < self.n) or b in self.prev:
            raise ValueError(b)
        self.prev[b], self.next[b] = self.last, None
        if self.last is None:
            self.first = b
        else:
            self.next[self.last] = b
        self.last = b

    def remove(self, b):
        if b not in self.prev:
            raise ValueError(b)
        p, n = self.prev.pop(b), self.next.pop(b)
        if p is None:
            self.first = n
        else:
            self.next[p] = n
        if n is None:
            self.last = p
        else:
            self.prev[n] = p


StudentFreeBlockQueue = DictFreeBlockQueue
