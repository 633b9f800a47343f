"""An O(1) free block queue: a doubly linked list threaded through the block ids (chapter 03).

The BlockManager's free queue needs four operations: take the head (``popleft``), release to
the tail (``append``), count (``len``) -- and, when a prefix-cache hit revives a block that
is free but still cached, take that block out of the *middle* (``remove``). A ``deque`` does
the first three in O(1) but ``deque.remove`` scans from the head, O(n) in the queue length:
with 100k+ free blocks every revival walks a long way.

``FreeBlockQueue`` keeps, per block id, the id of the block before it and after it
(``prev``/``next``), as vLLM v1's ``FreeKVCacheBlockQueue`` keeps links on each block. A
removal just joins the two neighbours: O(1) wherever the block sits. The order of the
queue -- and so every block id the BlockManager hands out -- is the same as with a deque.

The links live in two arrays of machine integers (``array("q")``) rather than lists: an
array stores the numbers themselves, a list stores pointers to int objects elsewhere in
memory. With a million blocks almost every access misses the CPU cache, and the array
saves one miss per link read (the benchmark measures it: benchmarks/block_manager_ops.py).
"""
from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator

from course_pkg.validation import check_int

_NONE = -1  # "no link": the block is not in the queue


class FreeBlockQueue:
    """Free block ids in FIFO order, with O(1) ``popleft``, ``append`` and ``remove``.

    Block ids are ``0 .. num_blocks - 1``. Two sentinel nodes, ``head`` (id ``num_blocks``)
    and ``tail`` (id ``num_blocks + 1``), are always linked, so no operation needs a special
    case for an empty queue or an end. Invariant: ``_prev[b] == _NONE`` exactly when block
    ``b`` is not in the queue; following ``_next`` from the head visits every queued block
    once, in queue order, and ends at the tail.
    """

    __slots__ = ("num_blocks", "_head", "_tail", "_prev", "_next", "_len")

    def __init__(self, num_blocks: int, block_ids: Iterable[int] | None = None):
        """A queue over ids ``0 .. num_blocks - 1`` holding ``block_ids`` in that order
        (all ids in ascending order when ``block_ids`` is None, like ``deque(range(n))``)."""
        check_int("num_blocks", num_blocks, minimum=0)
        self.num_blocks = num_blocks
        self._head = num_blocks
        self._tail = num_blocks + 1
        self._prev = array("q", [_NONE]) * (num_blocks + 2)
        self._next = array("q", [_NONE]) * (num_blocks + 2)
        self._next[self._head] = self._tail
        self._prev[self._tail] = self._head
        self._len = 0
        if block_ids is None:
            self._link_all_in_order()
        else:
            for block_id in block_ids:
                self.append(block_id)

    def _link_all_in_order(self) -> None:
        # The common start (every block free, ascending), built in one pass.
        n = self.num_blocks
        if n == 0:
            return
        self._next[:n] = array("q", range(1, n + 1))
        self._prev[:n] = array("q", range(-1, n - 1))
        self._prev[0] = self._head
        self._next[n - 1] = self._tail
        self._next[self._head] = 0
        self._prev[self._tail] = n - 1
        self._len = n

    def _check_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id!r} is not in 0..{self.num_blocks - 1}")

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block_id: object) -> bool:
        return isinstance(block_id, int) and 0 <= block_id < self.num_blocks and self._prev[block_id] != _NONE

    def __iter__(self) -> Iterator[int]:
        """Block ids from head (allocated next) to tail (freed most recently)."""
        nxt = self._next
        b = nxt[self._head]
        while b != self._tail:
            yield b
            b = nxt[b]

    def __repr__(self) -> str:
        return f"FreeBlockQueue({list(self)})"

    # popleft and append run once per block handed out and per block released: written out in
    # full, with the checks a wrong id needs folded into one test.

    def popleft(self) -> int:
        """Remove and return the block at the head (freed longest ago)."""
        if self._len == 0:
            raise IndexError("pop from an empty FreeBlockQueue")
        prev, nxt = self._prev, self._next
        block_id = nxt[self._head]
        after = nxt[block_id]
        nxt[self._head] = after
        prev[after] = self._head
        prev[block_id] = nxt[block_id] = _NONE
        self._len -= 1
        return block_id

    def append(self, block_id: int) -> None:
        """Put ``block_id`` at the tail (it becomes the most recently freed)."""
        prev, nxt = self._prev, self._next
        if type(block_id) is not int or not 0 <= block_id < self.num_blocks or prev[block_id] != _NONE:
            return self._link_after(prev[self._tail], block_id)   # (it raises, naming what is wrong)
        before = prev[self._tail]
        nxt[before] = block_id
        prev[block_id] = before
        nxt[block_id] = self._tail
        prev[self._tail] = block_id
        self._len += 1

    def appendleft(self, block_id: int) -> None:
        """Put ``block_id`` at the head: it is handed out next (speculative decoding gives back
        the blocks it just took there, chapter 14)."""
        self._link_after(self._head, block_id)

    def remove(self, block_id: int) -> None:
        """Take ``block_id`` out of the queue wherever it is: O(1), unlike ``deque.remove``."""
        self._check_id(block_id)
        if self._prev[block_id] == _NONE:
            raise ValueError(f"block {block_id} is not in the free queue")
        before, after = self._prev[block_id], self._next[block_id]
        self._next[before] = after
        self._prev[after] = before
        self._prev[block_id] = self._next[block_id] = _NONE
        self._len -= 1

    def _link_after(self, before: int, block_id: int) -> None:
        """Put ``block_id`` right behind ``before`` (a block in the queue, or the head sentinel)."""
        prev, nxt = self._prev, self._next
        if type(block_id) is not int or not 0 <= block_id < self.num_blocks or prev[block_id] != _NONE:
            self._check_id(block_id)
            raise ValueError(f"block {block_id} is already in the free queue")
        after = nxt[before]
        nxt[before] = block_id
        prev[block_id] = before
        nxt[block_id] = after
        prev[after] = block_id
        self._len += 1
