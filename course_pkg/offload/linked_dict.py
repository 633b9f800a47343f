"""An ordered dict threaded as a doubly linked list through plain dicts: chapter 03's free queue,
keyed by block hash instead of block id.

The tier's policies keep their blocks in recency order -- least recently used first -- and need
four operations in O(1): look a hash up, add one at the end, take one out wherever it is, and
move one to the end (a ``touch``). ``collections.OrderedDict`` does all four, but it cannot be
part of a step's transaction: the journal (``course_pkg.undo``) undoes a change by writing its
inverse first, and OrderedDict offers no way to put a key back *where it was* once it moved.
Here every change is a handful of dict assignments -- the value, and the links of the key and
its two neighbours -- and the journal undoes dict assignments exactly, so the order comes back
with them. (The free queue keeps its links in arrays because block ids are ``0 .. n - 1``;
hashes are not, so the links live in dicts.)
"""
from __future__ import annotations

from collections.abc import Iterator

_HEAD, _TAIL = ("head",), ("tail",)   # sentinels (tuples: equal in every copy, and never a hash)


class LinkedDict:
    """``OrderedDict``'s calls that the tier uses, oldest key first: ``d[k]``, ``d.get``,
    ``d[k] = v`` (a new key goes to the end; an existing one keeps its place), ``del d[k]``,
    ``d.pop``, ``d.move_to_end(k)``, ``d.popitem(last=False)``, ``len``, ``in``, iteration,
    ``keys``, ``values``, ``items``."""

    def __init__(self, items=()):
        self._values: dict = {}
        self._prev: dict = {_TAIL: _HEAD}
        self._next: dict = {_HEAD: _TAIL}
        for key, value in dict(items).items():
            self[key] = value

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key) -> bool:
        return key in self._values

    def __getitem__(self, key):
        return self._values[key]

    def get(self, key, default=None):
        return self._values.get(key, default)

    def __iter__(self) -> Iterator:
        nxt, key = self._next, self._next[_HEAD]
        while key != _TAIL:
            yield key
            key = nxt[key]

    def keys(self):
        return list(self)

    def values(self):
        return [self._values[k] for k in self]

    def items(self):
        values = self._values
        return ((k, values[k]) for k in self)

    def __repr__(self) -> str:
        return f"LinkedDict({dict(self.items())!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, LinkedDict) and list(self.items()) == list(other.items())

    def __setitem__(self, key, value) -> None:
        if key not in self._values:
            self._link_before(_TAIL, key)
        self._values[key] = value

    def __delitem__(self, key) -> None:
        del self._values[key]   # (raises KeyError, changing nothing, for a key that is not here)
        self._unlink(key)

    def pop(self, key, *default):
        if key not in self._values:
            if default:
                return default[0]
            raise KeyError(key)
        value = self._values[key]
        del self[key]
        return value

    def popitem(self, last: bool = True):
        """Remove and return the newest ``(key, value)`` -- the oldest with ``last=False``."""
        if not self._values:
            raise KeyError("popitem(): the dictionary is empty")
        key = self._prev[_TAIL] if last else self._next[_HEAD]
        return key, self.pop(key)

    def move_to_end(self, key) -> None:
        """Make ``key`` the newest."""
        if key not in self._values:
            raise KeyError(key)
        self._unlink(key)
        self._link_before(_TAIL, key)

    def _link_before(self, after, key) -> None:
        before = self._prev[after]
        self._next[before] = key
        self._prev[key] = before
        self._next[key] = after
        self._prev[after] = key

    def _unlink(self, key) -> None:
        before, after = self._prev.pop(key), self._next.pop(key)
        self._next[before] = after
        self._prev[after] = before
