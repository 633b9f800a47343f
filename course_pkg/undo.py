"""The undo log: one engine step is a transaction (chapter 06; ARCHITECTURE.md, "The step").

A step changes a lot in place: the scheduler's queues and counters, every block's ref count,
the free queue, the prefix-cache index, the CPU block pool, the sequences' block tables and
tokens, the random generators of the sampler. If anything raises half-way -- the model, the
sampler, a bug, a KeyboardInterrupt -- a step left half done corrupts the engine for good.

Databases met this problem long ago and solved it with an *undo log*: before each change,
write down how to reverse it; if the transaction fails, play the log backwards; if it
succeeds, throw the log away. The step does the same. Every mutation a step makes goes
through one of the few primitives below (or, for a change with no generic inverse, records
its own with ``record``), and ``rollback`` undoes them newest first, so each inverse runs on
exactly the state its change left behind.

Outside a step nothing is recorded: the block manager and the scheduler keep ``undo_log =
None`` and pay one ``is None`` test per change.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MISSING = object()


class UndoLog:
    """The inverses of a transaction's changes, newest last; ``rollback`` runs them backwards.

    One thing an undo log cannot give back is memory the step overwrote. ``kv_written`` is set
    by whoever owns the KV tensors just before the step first writes into them (block copies,
    swap-ins, the forward pass), and ``new_blocks`` lists the device blocks the step took from
    the free queue for new content. Once ``kv_written``, those blocks' old K/V are gone: after
    the rollback their prefix-cache entries are dropped, and a sequence that holds one again
    (a victim the step had preempted) is recomputed (``BlockManager.forget_overwritten``).
    """

    __slots__ = ("_undo", "kv_written", "new_blocks")

    def __init__(self) -> None:
        self._undo: list[Callable[[], Any]] = []
        self.kv_written = False
        self.new_blocks: list[int] = []

    def __len__(self) -> int:
        return len(self._undo)

    def record(self, undo: Callable[[], Any]) -> None:
        """Remember ``undo``, a call that reverses the change just made."""
        self._undo.append(undo)

    def rollback(self) -> None:
        """Undo every recorded change, newest first; the log is empty afterwards.

        Each inverse is taken off the log before it runs, so a rollback interrupted part-way
        can be called again and carries on where it stopped.
        """
        undo = self._undo
        while undo:
            undo.pop()()

    def commit(self) -> None:
        """The transaction succeeded: forget how to undo it."""
        self._undo.clear()

    # ---------------------------------------------------------------- the primitives

    def save(self, obj: Any, *names: str) -> None:
        """Record ``obj``'s attributes ``names`` as they are now (their before-image).

        Lists are copied, and restored in place, so every holder of the list sees it undone.
        """
        image = [(name, value[:] if isinstance(value, list) else value)
                 for name in names for value in (getattr(obj, name),)]

        def restore():
            for name, value in image:
                if isinstance(value, list):
                    getattr(obj, name)[:] = value
                else:
                    setattr(obj, name, value)
        self._undo.append(restore)

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        """``obj.name = value``, undoable."""
        old = getattr(obj, name)
        setattr(obj, name, value)
        self._undo.append(lambda: setattr(obj, name, old))

    def add(self, obj: Any, name: str, delta: int) -> None:
        """``obj.name += delta`` (a counter), undoable."""
        setattr(obj, name, getattr(obj, name) + delta)
        self._undo.append(lambda: setattr(obj, name, getattr(obj, name) - delta))

    def append(self, items, item) -> None:
        """``items.append(item)`` (a list or a deque), undoable."""
        items.append(item)
        self._undo.append(items.pop)

    def appendleft(self, items, item) -> None:
        """``items.appendleft(item)`` (a deque), undoable."""
        items.appendleft(item)
        self._undo.append(items.popleft)

    def insert(self, items, index: int, item) -> None:
        """``items.insert(index, item)``, undoable."""
        items.insert(index, item)
        self._undo.append(lambda: items.__delitem__(index))

    def remove(self, items, item) -> None:
        """``items.remove(item)``, undoable: it comes back at the place it had."""
        index = items.index(item)
        del items[index]
        self._undo.append(lambda: items.insert(index, item))

    def setitem(self, mapping, key, value) -> None:
        """``mapping[key] = value`` (a dict), undoable."""
        old = mapping.get(key, _MISSING)
        mapping[key] = value
        self._undo.append(lambda: mapping.pop(key) if old is _MISSING else mapping.__setitem__(key, old))

    def delitem(self, mapping, key) -> None:
        """``del mapping[key]`` (a dict), undoable."""
        old = mapping.pop(key)
        self._undo.append(lambda: mapping.__setitem__(key, old))
