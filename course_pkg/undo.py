"""The journal: one engine step is a transaction (chapter 06; ARCHITECTURE.md, "The journal").

A step changes a lot in place: the scheduler's queues and counters, every block's ref count,
the free queue, the prefix-cache index, the CPU block pool, the sequences' block tables and
tokens. If anything raises half-way -- the model, the sampler, a bug, a KeyboardInterrupt -- a
step left half done corrupts the engine for good.

Databases met this problem long ago and solved it with an *undo log*: before a transaction
changes a page, it writes the page's before-image to the log; if the transaction fails, the
log is played backwards; if it succeeds, the log is thrown away. This module does the same for
Python objects, and it does it *by itself*: the code the chapters teach (``block.py``,
``sequence.py``, ``free_block_queue.py``, ``block_manager.py``, the scheduler's decisions) is
plain Python that knows nothing of it.

* ``Journal.adopt(obj)`` enrols an object: its class is swapped for a *watched* subclass (same
  name, same fields) whose ``__setattr__`` writes the object's before-image -- all its fields --
  to the journal at its first change in a transaction, then swaps the object to an unwatched
  twin, so that its later changes in that transaction cost nothing (at the end it is watched
  again). Every list, dict, set, deque or array it holds is swapped for a journaled copy whose
  mutating methods write how to reverse them first (``append`` -> "cut back to this length",
  ``d[k] = v`` -> "put the old value back", ``remove`` -> "put it back at its place"): the
  free queue's links or the prefix index are far too big to copy for each change. What an
  enrolled object takes in later -- a sequence put into a queue, a list assigned to a field --
  is enrolled with it, so the whole reachable state stays journaled. Only instances of the
  classes named by ``follow`` are enrolled (the scheduler names the core's: a step changes
  nothing else).
* ``Journal.begin`` starts recording; ``commit`` forgets the log (its first line is the commit
  point); ``rollback`` runs it backwards, newest first, so each inverse meets exactly the
  state its change left behind.
* ``deferred_interrupts`` holds a SIGINT while the engine opens, commits or hands out a step.

Every record is written *before* its change (write-ahead), and every inverse is idempotent: it
puts back a saved value or cuts back to a saved length. So an interrupt that lands between a
record and its change is harmless (undoing a change that did not happen restores what is there
already), and ``rollback`` runs an inverse before it drops it from the log: a rollback cut
short by a second fault is simply run again. Outside a transaction an enrolled object pays one
test per change; objects never enrolled (a BlockManager of chapters 02-04 on its own) pay
nothing at all.

What no journal can give back is memory: the K/V a step wrote into the cache. The model
runner knows which slots it wrote (``ModelRunner.written_slots``); after a rollback the blocks
they belong to lose their cache entries and a sequence whose computed tokens were overwritten
is recomputed (``BlockManager.forget_overwritten``).
"""
from __future__ import annotations

import _signal
import copyreg
import signal
import threading
import weakref
from array import array
from collections import deque
from contextlib import contextmanager
from operator import attrgetter
from typing import Any

_MISSING = object()
# The plain setters, looked up once: ``object.__setattr__(obj, "__class__", c)`` spells the
# same thing but costs four times as much, and a step swaps classes twice per changed object.
_set_class = object.__dict__["__class__"].__set__
_plain_setattr = object.__setattr__
_SCALARS = frozenset({int, float, bool, str, bytes, type(None), tuple, frozenset, complex})
_SIGINT = int(signal.SIGINT)
_open = threading.local()   # .journals: the journals recording on this thread (weakly held)


def _open_journals() -> weakref.WeakSet:
    journals = getattr(_open, "journals", None)
    if journals is None:
        journals = _open.journals = weakref.WeakSet()
    return journals


class Journal:
    """The undo log of one engine (or of one ``transaction``): the inverses of the open
    transaction's changes, oldest first.

    ``follow``: the classes whose instances ``adopt`` enrols, met as fields of an enrolled object
    or as items of its containers (subclasses included).
    """

    def __init__(self, follow: tuple[type, ...] = ()):
        self.follow = tuple(follow)
        self.recording = False
        self._log: list[tuple] = []
        self._saved: list[Any] = []   # objects whose before-image this transaction holds (see _save)
        self._classes: dict[type, type | None] = {}   # class -> its watched subclass (None: not followed)

    def __len__(self) -> int:
        return len(self._log)

    def __repr__(self) -> str:
        return f"Journal({'open' if self.recording else 'closed'}, {len(self._log)} entries)"

    # ------------------------------------------------------------ the transaction

    def begin(self) -> None:
        """Start recording every change of the enrolled objects."""
        if self.recording:
            raise RuntimeError("this journal's transaction is open already")
        self._end()   # (what an interrupted commit or rollback left behind)
        self.recording = True
        _open_journals().add(self)

    def commit(self) -> None:
        """The transaction succeeded: forget how to undo it.

        Its first line is the commit point: once ``recording`` is False the transaction
        stands, whatever interrupts the clean-up after it (``rollback`` then does nothing but
        finish that clean-up, and so does the next ``begin``)."""
        self.recording = False
        self._end()

    def rollback(self) -> None:
        """Undo every recorded change, newest first, and close the transaction.

        Each inverse runs before it leaves the log, and every inverse may run twice: a rollback
        interrupted part-way is finished by calling it again (the journal stays open until then).
        A journal that is not recording has nothing to undo: its transaction committed (or was
        rolled back) already.
        """
        if not self.recording:
            self._end()
            return
        log = self._log
        while log:
            undo, *args = log[-1]
            undo(*args)
            log.pop()
        self.recording = False
        self._end()

    def _end(self) -> None:
        """The clean-up after a commit or a rollback; every part of it may run again."""
        self._log.clear()
        self._unsave(refresh=True)
        _open_journals().discard(self)

    # ------------------------------------------------------------ before-images

    def _save(self, obj: Any) -> None:
        """``obj``'s first change in this transaction: write its before-image (every field; the
        containers it holds journal themselves), then let it change freely until the
        transaction ends -- its class becomes the unwatched twin, so later writes cost nothing."""
        cls = type(obj)
        self._log.append((_restore_object, obj, obj.__dict__.copy() if cls._has_dict else None,
                          cls._get_slots(obj) if cls._slot_names else ()))
        self._saved.append(obj)
        _set_class(obj, cls._unwatched)

    def _unsave(self, refresh: bool) -> None:
        """Watch the saved objects again. After a commit (``refresh``), a container or object
        assigned to one of their fields while unwatched is enrolled now.

        Every line may run twice (an interrupt, then the next ``begin``): watching an object
        again, or enrolling what is enrolled already, changes nothing."""
        saved = self._saved
        for obj in saved:
            cls = type(obj)
            if refresh:
                for name in cls._references:
                    value = getattr(obj, name, None)
                    if type(value) in _CONTAINERS:
                        _plain_setattr(obj, name, _adopt(self, value))
            _set_class(obj, cls._watched)
        saved.clear()

    # ------------------------------------------------------------ enrolment

    def adopt(self, obj: Any) -> Any:
        """Enrol ``obj`` (and what it holds) in this journal; returns it. Objects that are not
        instances of a followed class, or are enrolled already, are returned as they are."""
        return _adopt(self, obj)

    def journaled_class(self, cls: type) -> type | None:
        """``cls``'s journaled subclass in this journal, made on first use; None if ``cls`` is
        not followed (or is itself journaled)."""
        try:
            return self._classes[cls]
        except KeyError:
            pass
        if getattr(cls, "_journal", None) is not None or not issubclass(cls, self.follow):
            sub = None
        else:
            shared = {"__slots__": (), "_journal": self, "__reduce_ex__": _reduce_as_plain,
                      "__module__": cls.__module__, "_has_dict": cls.__dictoffset__ != 0,
                      "_slot_names": tuple(_slot_names(cls)), "_references": set()}
            shared["_get_slots"] = _slot_getter(shared["_slot_names"])
            sub = type(cls.__name__, (cls,), {**shared, "__setattr__": _first_change})
            twin = type(cls.__name__, (cls,), shared)   # the same, unwatched: for a saved object
            for c in (sub, twin):
                c.__qualname__, c._watched, c._unwatched = cls.__qualname__, sub, twin
            twin._references = sub._references
            self._classes[cls] = self._classes[sub] = self._classes[twin] = None
        self._classes[cls] = sub
        return sub


def _adopt(journal: Journal, obj: Any) -> Any:
    """Enrol ``obj``: swap its class and journal its containers (see the module docstring)."""
    cls = type(obj)
    if cls in _SCALARS:
        return obj
    container = _CONTAINERS.get(cls)
    if container is not None:
        return container(journal, obj)
    sub = journal.journaled_class(cls)
    if sub is None:
        return obj
    _set_class(obj, sub)
    if sub._has_dict:   # a dict of its own: the one it had is laid out for its old class (slow to read)
        object.__setattr__(obj, "__dict__", dict(obj.__dict__))
    for name in list(getattr(obj, "__dict__", ())) + list(sub._slot_names):
        value = getattr(obj, name, _MISSING)
        if value is not _MISSING and type(value) not in _SCALARS:
            adopted = _adopt(journal, value)
            if adopted is not value:
                object.__setattr__(obj, name, adopted)
            if adopted is not value or getattr(type(adopted), "_journal", None) is journal:
                sub._references.add(name)   # a field that holds a container or an enrolled object
    return obj


def _slot_names(cls: type) -> list[str]:
    names = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [s for s in slots if s not in ("__dict__", "__weakref__")]
    return names


def _first_change(self, name: str, value: Any) -> None:
    """``__setattr__`` of an enrolled object that has not changed in the open transaction."""
    journal = self._journal
    if journal.recording:
        journal._save(self)
    if type(value) not in _SCALARS:
        adopted = _adopt(journal, value)
        if adopted is not value or getattr(type(adopted), "_journal", None) is journal:
            type(self)._references.add(name)
        value = adopted
    _plain_setattr(self, name, value)


def _slot_getter(names: tuple[str, ...]):
    """``obj -> tuple of its slots' values`` (``_MISSING`` for an empty one): ``attrgetter``, in
    C, while every slot is set (the usual case), else one ``getattr`` per slot."""
    if not names:
        return lambda obj: ()
    get_set = attrgetter(*names) if len(names) > 1 else (lambda obj: (getattr(obj, names[0]),))

    def get(obj):
        try:
            return get_set(obj)
        except AttributeError:
            return tuple(getattr(obj, name, _MISSING) for name in names)
    return get


def _restore_object(obj: Any, fields: dict | None, slots: tuple) -> None:
    if fields is not None:
        obj.__dict__.clear()
        obj.__dict__.update(fields)
    for name, value in zip(type(obj)._slot_names, slots):
        _restore_attribute(obj, name, value)


def _reduce_as_plain(self, protocol):
    """Copies (``copy``, ``deepcopy``, pickle) of an enrolled object are plain objects."""
    rv = object.__reduce_ex__(self, protocol)
    if isinstance(rv, tuple) and rv and rv[0] is copyreg.__newobj__:
        rv = (rv[0], (type(self).__mro__[1],) + tuple(rv[1][1:])) + tuple(rv[2:])
    return rv


def _restore_attribute(obj: Any, name: str, old: Any) -> None:
    if old is _MISSING:
        if hasattr(obj, name):
            object.__delattr__(obj, name)
    else:
        object.__setattr__(obj, name, old)


# ---------------------------------------------------------------- journaled containers
#
# Each mutating method writes its inverse first, then calls the plain method. The cheap,
# frequent changes get an exact inverse (a length to cut back to, an old value to put back);
# the rare ones save a copy of the whole container.

def _note(container, *record) -> None:
    journal = container._journal
    if journal.recording:
        journal._log.append(record)


def _adopt_item(container, item):
    return item if type(item) in _SCALARS else _adopt(container._journal, item)


def _restore_list(lst, items) -> None:
    list.__setitem__(lst, slice(None), items)


def _cut_list(lst, n: int) -> None:
    list.__delitem__(lst, slice(n, None))


class JournaledList(list):
    """A list whose changes are journaled (see the module docstring)."""

    __slots__ = ("_journal",)

    def __reduce__(self):
        return list, (list(self),)

    def __init__(self, journal: Journal, items=()):
        list.__init__(self, items)
        self._journal = journal
        for i, item in enumerate(self):
            if type(item) not in _SCALARS:
                list.__setitem__(self, i, _adopt(journal, item))

    def append(self, item) -> None:
        journal = self._journal
        if journal.recording:
            journal._log.append((_cut_list, self, len(self)))
        list.append(self, item if type(item) in _SCALARS else _adopt(journal, item))

    def extend(self, items) -> None:
        _note(self, _cut_list, self, len(self))
        list.extend(self, [_adopt_item(self, x) for x in items])

    def __iadd__(self, items):
        self.extend(items)
        return self

    def _whole(self):
        _note(self, _restore_list, self, list(self))

    def insert(self, index, item) -> None:
        self._whole()
        list.insert(self, index, _adopt_item(self, item))

    def __setitem__(self, key, value) -> None:
        self._whole()
        if isinstance(key, slice):
            value = [_adopt_item(self, x) for x in value]
        else:
            value = _adopt_item(self, value)
        list.__setitem__(self, key, value)

    def __delitem__(self, key) -> None:
        self._whole()
        list.__delitem__(self, key)

    def pop(self, index=-1):
        self._whole()
        return list.pop(self, index)

    def remove(self, item) -> None:
        self._whole()
        list.remove(self, item)

    def clear(self) -> None:
        self._whole()
        list.clear(self)

    def sort(self, *args, **kwargs) -> None:
        self._whole()
        list.sort(self, *args, **kwargs)

    def reverse(self) -> None:
        self._whole()
        list.reverse(self)

    def __imul__(self, n):
        self._whole()
        return list.__imul__(self, n)


def _restore_key(d, key, old) -> None:
    if old is _MISSING:
        dict.pop(d, key, None)
    else:
        dict.__setitem__(d, key, old)


def _restore_dict(d, items) -> None:
    dict.clear(d)
    dict.update(d, items)


class JournaledDict(dict):
    """A dict whose changes are journaled."""

    __slots__ = ("_journal",)

    def __reduce__(self):
        return dict, (dict(self),)

    def __init__(self, journal: Journal, items=()):
        dict.__init__(self, items)
        self._journal = journal
        for key, value in self.items():
            if type(value) not in _SCALARS:
                dict.__setitem__(self, key, _adopt(journal, value))

    def __setitem__(self, key, value) -> None:
        journal = self._journal
        if journal.recording:
            journal._log.append((_restore_key, self, key, dict.get(self, key, _MISSING)))
        dict.__setitem__(self, key, value if type(value) in _SCALARS else _adopt(journal, value))

    def __delitem__(self, key) -> None:
        _note(self, _restore_key, self, key, dict.get(self, key, _MISSING))
        dict.__delitem__(self, key)

    def pop(self, key, *default):
        _note(self, _restore_key, self, key, dict.get(self, key, _MISSING))
        return dict.pop(self, key, *default)

    def setdefault(self, key, default=None):
        if key in self:
            return dict.__getitem__(self, key)
        self[key] = default
        return dict.__getitem__(self, key)

    def _whole(self):
        _note(self, _restore_dict, self, dict(self))

    def popitem(self):
        self._whole()
        return dict.popitem(self)

    def clear(self) -> None:
        self._whole()
        dict.clear(self)

    def update(self, *args, **kwargs) -> None:
        self._whole()
        for key, value in dict(*args, **kwargs).items():
            dict.__setitem__(self, key, _adopt_item(self, value))

    def __ior__(self, other):
        self.update(other)
        return self


def _restore_member(s, item, was_in: bool) -> None:
    if was_in:
        set.add(s, item)
    else:
        set.discard(s, item)


def _restore_set(s, items) -> None:
    set.clear(s)
    set.update(s, items)


class JournaledSet(set):
    """A set whose changes are journaled."""

    __slots__ = ("_journal",)

    def __init__(self, journal: Journal, items=()):
        set.__init__(self, items)
        self._journal = journal

    def __repr__(self) -> str:
        return repr(set(self))

    def __reduce__(self):
        return set, (list(self),)

    def add(self, item) -> None:
        journal = self._journal
        if journal.recording:
            journal._log.append((_restore_member, self, item, item in self))
        set.add(self, item)

    def discard(self, item) -> None:
        _note(self, _restore_member, self, item, item in self)
        set.discard(self, item)

    def remove(self, item) -> None:
        journal = self._journal
        if journal.recording:
            journal._log.append((_restore_member, self, item, item in self))
        set.remove(self, item)

    def _whole(self):
        _note(self, _restore_set, self, set(self))

    def pop(self):
        self._whole()
        return set.pop(self)

    def clear(self) -> None:
        self._whole()
        set.clear(self)

    def update(self, *others) -> None:
        self._whole()
        set.update(self, *others)

    def difference_update(self, *others) -> None:
        self._whole()
        set.difference_update(self, *others)

    def intersection_update(self, *others) -> None:
        self._whole()
        set.intersection_update(self, *others)

    def symmetric_difference_update(self, other) -> None:
        self._whole()
        set.symmetric_difference_update(self, other)

    def __ior__(self, other):
        self.update(other)
        return self

    def __iand__(self, other):
        self.intersection_update(other)
        return self

    def __isub__(self, other):
        self.difference_update(other)
        return self

    def __ixor__(self, other):
        self.symmetric_difference_update(other)
        return self


def _cut_right(d, n: int) -> None:
    while len(d) > n:
        deque.pop(d)


def _cut_left(d, n: int) -> None:
    while len(d) > n:
        deque.popleft(d)


def _put_back_right(d, n: int, item) -> None:
    if len(d) < n:
        deque.append(d, item)


def _put_back_left(d, n: int, item) -> None:
    if len(d) < n:
        deque.appendleft(d, item)


def _put_back_at(d, n: int, index: int, item) -> None:
    if len(d) < n:
        deque.insert(d, index, item)


def _restore_deque(d, items) -> None:
    deque.clear(d)
    deque.extend(d, items)


class JournaledDeque(deque):
    """A deque whose changes are journaled. (A bounded deque that is full drops an item on
    every append: those appends save the whole deque.)"""

    __slots__ = ("_journal",)

    def __init__(self, journal: Journal, items=(), maxlen=None):
        deque.__init__(self, items, maxlen)
        self._journal = journal
        for i, item in enumerate(self):
            if type(item) not in _SCALARS:
                deque.__setitem__(self, i, _adopt(journal, item))

    def __repr__(self) -> str:
        return repr(deque(self, self.maxlen))

    def __reduce__(self):
        return deque, (list(self), self.maxlen)

    def _whole(self):
        _note(self, _restore_deque, self, list(self))

    def _full(self) -> bool:
        return self.maxlen is not None and len(self) >= self.maxlen

    def append(self, item) -> None:
        if self._full():
            self._whole()
        else:
            _note(self, _cut_right, self, len(self))
        deque.append(self, _adopt_item(self, item))

    def appendleft(self, item) -> None:
        if self._full():
            self._whole()
        else:
            _note(self, _cut_left, self, len(self))
        deque.appendleft(self, _adopt_item(self, item))

    def pop(self):
        if self:
            _note(self, _put_back_right, self, len(self), self[-1])
        return deque.pop(self)

    def popleft(self):
        if self:
            _note(self, _put_back_left, self, len(self), self[0])
        return deque.popleft(self)

    def remove(self, item) -> None:
        index = deque.index(self, item)
        _note(self, _put_back_at, self, len(self), index, deque.__getitem__(self, index))
        deque.__delitem__(self, index)

    def insert(self, index, item) -> None:
        self._whole()
        deque.insert(self, index, _adopt_item(self, item))

    def extend(self, items) -> None:
        items = [_adopt_item(self, x) for x in items]
        if self.maxlen is not None:
            self._whole()
        else:
            _note(self, _cut_right, self, len(self))
        deque.extend(self, items)

    def extendleft(self, items) -> None:
        items = [_adopt_item(self, x) for x in items]
        if self.maxlen is not None:
            self._whole()
        else:
            _note(self, _cut_left, self, len(self))
        deque.extendleft(self, items)

    def __iadd__(self, items):
        self.extend(items)
        return self

    def clear(self) -> None:
        self._whole()
        deque.clear(self)

    def rotate(self, n=1) -> None:
        self._whole()
        deque.rotate(self, n)

    def reverse(self) -> None:
        self._whole()
        deque.reverse(self)

    def __setitem__(self, index, value) -> None:
        self._whole()
        deque.__setitem__(self, index, _adopt_item(self, value))

    def __delitem__(self, index) -> None:
        self._whole()
        deque.__delitem__(self, index)


def _restore_array_item(a, index: int, old) -> None:
    array.__setitem__(a, index, old)


def _restore_array(a, items) -> None:
    array.__setitem__(a, slice(None), items)


class JournaledArray(array):
    """An ``array.array`` whose item assignments are journaled (the free queue's links)."""

    __slots__ = ("_journal",)

    def __new__(cls, journal: Journal, items: array):
        self = array.__new__(cls, items.typecode, items)
        self._journal = journal
        return self

    def __repr__(self) -> str:
        return repr(array(self.typecode, self))

    def __reduce__(self):
        return array, (self.typecode, list(self))

    def __setitem__(self, index, value) -> None:
        journal = self._journal
        if journal.recording:
            if type(index) is int:
                journal._log.append((_restore_array_item, self, index, array.__getitem__(self, index)))
            else:
                journal._log.append((_restore_array, self, array(self.typecode, self)))
        array.__setitem__(self, index, value)

    def __delitem__(self, index) -> None:
        raise TypeError("a journaled array keeps its length")

    def append(self, item) -> None:
        raise TypeError("a journaled array keeps its length")

    extend = insert = pop = remove = fromlist = frombytes = append


_JOURNALED = frozenset({JournaledList, JournaledDict, JournaledSet, JournaledDeque, JournaledArray})
_CONTAINERS = {
    list: lambda journal, items: JournaledList(journal, items),
    dict: lambda journal, items: JournaledDict(journal, items),
    set: lambda journal, items: JournaledSet(journal, items),
    deque: lambda journal, items: JournaledDeque(journal, items, items.maxlen),
    array: lambda journal, items: JournaledArray(journal, items),
}


# ---------------------------------------------------------------- shared objects and one-off transactions

def share(obj: Any) -> Any:
    """Enrol an object that every engine of the process shares (the counter of sequence ids).

    It belongs to no journal: a change made while exactly one transaction is open on this
    thread is recorded there, and undone only if the attribute still holds what the change
    wrote -- so another thread's later change is never taken back (a counter never hands out
    a value twice). With no transaction, or several, open on the thread, nothing is recorded.
    """
    cls = type(obj)
    if not getattr(cls, "_shared", False):
        sub = type(cls.__name__, (cls,), {"__slots__": (), "_shared": True, "__setattr__": _shared_setattr,
                                          "__module__": cls.__module__})
        sub.__qualname__ = cls.__qualname__
        obj.__class__ = sub
    return obj


def _shared_setattr(self, name: str, value: Any) -> None:
    journals = _open_journals()
    if len(journals) == 1:
        for journal in journals:
            journal._log.append((_restore_shared, self, name, getattr(self, name, _MISSING), value))
    object.__setattr__(self, name, value)


def _restore_shared(obj: Any, name: str, old: Any, new: Any) -> None:
    if getattr(obj, name, _MISSING) is new or getattr(obj, name, _MISSING) == new:
        _restore_attribute(obj, name, old)


def journal_of(obj: Any) -> Journal | None:
    """The journal ``obj`` is enrolled in (an object or a journaled container), or None."""
    journal = getattr(obj, "_journal", None)
    return journal if isinstance(journal, Journal) else None


@contextmanager
def transaction(*roots, follow: tuple[type, ...] = ()):
    """``with transaction(block_manager, seq, ...) as journal:`` -- the changes made inside to
    ``roots`` and to what they hold are undone together if something raises, then it re-raises.

    Roots enrolled already (an engine's block manager) keep their journal; otherwise a new one
    follows ``follow`` plus the roots' own classes.
    """
    journals = {journal_of(r) for r in roots} - {None}
    if len(journals) > 1:
        raise ValueError("the roots of one transaction belong to different journals")
    journal = journals.pop() if journals else Journal(tuple(follow) + tuple({type(r) for r in roots}))
    if journal.recording:
        raise RuntimeError("a transaction of these objects is open already (a step is open?)")
    for root in roots:
        journal.adopt(root)
    try:   # (begin and commit inside the try: a fault on any line of them is undone, or committed)
        journal.begin()
        yield journal
        journal.commit()
    except BaseException:
        journal.rollback()
        raise


# ---------------------------------------------------------------- interrupts

class _HeldInterrupts:
    """The SIGINT handler of a ``deferred_interrupts`` block: while ``active`` it notes the
    signal; afterwards (if a fault kept it from being replaced back) it passes the signal on."""

    def __init__(self, previous):
        self.previous, self.active, self.held = previous, True, False

    def __call__(self, signum, frame):
        if self.active:
            self.held = True
        else:
            _pass_on(self.previous, signum, frame)


def _pass_on(handler, signum, frame) -> None:
    if callable(handler):
        handler(signum, frame)   # Python's default handler raises KeyboardInterrupt
    elif handler != signal.SIG_IGN:
        raise KeyboardInterrupt


@contextmanager
def deferred_interrupts():
    """Hold a KeyboardInterrupt -- SIGINT: Ctrl-C, or Jupyter's "interrupt the kernel" -- until
    the block ends, then raise it.

    The journal makes a step undoable at any line, and the engine's plumbing is written so
    that an exception on any of its lines is undone or completed; this closes the last gaps,
    between the bytecodes of one line, for the one fault that arrives from outside. Any other
    exception propagates at once. In a thread other than the main one (which never receives
    signals), inside another such block, or where the handler was not installed from Python,
    it changes nothing. A block that raises drops the held interrupt: its own exception stops
    the caller already.

    (It calls ``_signal``, the C module under ``signal``: ``signal.signal`` and ``getsignal``
    are the same calls plus a conversion to ``enum`` that costs ten times as much, and every
    step runs this block.)
    """
    current = _signal.getsignal(_SIGINT) if threading.get_ident() == threading.main_thread().ident else None
    if current is None or (isinstance(current, _HeldInterrupts) and current.active):
        yield
        return
    holder = _HeldInterrupts(current)
    _signal.signal(_SIGINT, holder)
    try:
        yield
    finally:
        holder.active = False   # (from here on it passes a signal on, even if left installed)
        _signal.signal(_SIGINT, current)
    if holder.held:
        _pass_on(current, _SIGINT, None)
