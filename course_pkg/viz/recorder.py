"""Record a snapshot after every public call on a BlockManager.

    rec = Recorder(BlockManager(8, 4))
    a = rec.name(Sequence([1, 2, 3, 4, 5], block_size=4), "A")
    bm = rec.watch()                      # use bm exactly like the real manager
    bm.allocate(a, bm.can_allocate(a))
    rec.labels                            # ['can_allocate(A) -> 0', 'allocate(A, 0)']

The proxy runs each call on the real manager and only then takes the snapshot, so a call
that raises records nothing (and, by the core's contract, changed nothing).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from course_pkg.block_manager import BlockManager
from course_pkg.sequence import Sequence
from course_pkg.viz.snapshot import Snapshot, take_snapshot

# The BlockManager's public calls; each one is recorded when made through the proxy.
RECORDED_CALLS = ("can_allocate", "allocate", "can_append", "may_append", "deallocate", "hash_blocks", "fork")
# Queries whose answer is part of the label ("can_append(A) -> True").
_QUERIES = ("can_allocate", "can_append")


class Recorder:
    """Snapshots of one BlockManager, one per recorded call, in call order.

    Sequences are shown under the names given with ``name(seq, "A")``; a sequence passed
    to a recorded call without a name is tracked as "seq <seq_id>". Every snapshot shows
    the block tables of all tracked sequences that hold blocks.
    """

    def __init__(self, block_manager: BlockManager,
                 seqs: Iterable[Sequence] | Mapping[str, Sequence] | None = None):
        if not isinstance(block_manager, BlockManager):
            raise TypeError(f"Recorder needs a BlockManager, got {type(block_manager).__name__}")
        self.block_manager = block_manager
        self.snapshots: list[Snapshot] = []
        self._names: dict[int, str] = {}          # seq_id -> display name, in tracking order
        self._seqs: dict[int, Sequence] = {}
        if isinstance(seqs, Mapping):
            for name, seq in seqs.items():
                self.name(seq, name)
        elif seqs is not None:
            for seq in seqs:
                self._track(seq)

    # ---------------------------------------------------------------- sequences

    def name(self, seq: Sequence, name: str) -> Sequence:
        """Show ``seq`` as ``name`` in labels and block tables; returns ``seq``."""
        if not isinstance(seq, Sequence):
            raise TypeError(f"name() needs a Sequence, got {type(seq).__name__}")
        name = str(name)
        for other_id, other_name in self._names.items():
            if other_name == name and other_id != seq.seq_id:
                raise ValueError(f"the name {name!r} is already used by sequence {other_id}")
        self._names[seq.seq_id] = name
        self._seqs[seq.seq_id] = seq
        return seq

    def _track(self, seq: Sequence) -> None:
        if seq.seq_id not in self._names:
            self.name(seq, f"seq {seq.seq_id}")

    @property
    def sequences(self) -> dict[str, Sequence]:
        """Tracked sequences by display name, in the order they were first seen."""
        return {self._names[i]: self._seqs[i] for i in self._names}

    @property
    def labels(self) -> list[str]:
        return [snap.label for snap in self.snapshots]

    # ---------------------------------------------------------------- recording

    def record(self, label: str) -> Snapshot:
        """Take a snapshot by hand (e.g. after an engine step) and append it."""
        snap = take_snapshot(self.block_manager, self.sequences, label)
        self.snapshots.append(snap)
        return snap

    def watch(self) -> "WatchedBlockManager":
        """A stand-in for the manager that records a snapshot after each public call."""
        return WatchedBlockManager(self)

    def _label(self, call: str, args: tuple, kwargs: dict, result) -> str:
        def fmt(value) -> str:
            if isinstance(value, Sequence):
                return self._names[value.seq_id]
            return repr(value)

        parts = [fmt(a) for a in args] + [f"{k}={fmt(v)}" for k, v in kwargs.items()]
        label = f"{call}({', '.join(parts)})"
        if call in _QUERIES:
            label += f" -> {result!r}"
        elif call == "may_append" and result:   # copy-on-write: name the copies
            label += " -> copy " + ", ".join(f"{src}->{dst}" for src, dst in result)
        return label

    def _call(self, call: str, args: tuple, kwargs: dict):
        for value in (*args, *kwargs.values()):
            if isinstance(value, Sequence):
                self._track(value)
        # Run first: if the call raises, nothing is recorded.
        result = getattr(self.block_manager, call)(*args, **kwargs)
        self.record(self._label(call, args, kwargs, result))
        return result


class WatchedBlockManager:
    """Proxy returned by ``Recorder.watch()``: the real manager's calls, each one recorded.

    Attributes (``blocks``, ``free_block_ids``, ...) read through to the real manager;
    setting attributes on the proxy is refused, so the state can change only through calls.
    """

    __slots__ = ("_recorder",)

    def __init__(self, recorder: Recorder):
        object.__setattr__(self, "_recorder", recorder)

    def __getattr__(self, attr: str):
        recorder = object.__getattribute__(self, "_recorder")
        if attr in RECORDED_CALLS:
            def recorded(*args, **kwargs):
                return recorder._call(attr, args, kwargs)
            recorded.__name__ = attr
            recorded.__doc__ = getattr(BlockManager, attr).__doc__
            return recorded
        return getattr(recorder.block_manager, attr)

    def __setattr__(self, attr: str, value) -> None:
        raise AttributeError(f"cannot set {attr!r} through the recording proxy; "
                             "change the state with the manager's calls")

    def __repr__(self) -> str:
        bm = object.__getattribute__(self, "_recorder").block_manager
        return (f"<recorded BlockManager: {bm.num_blocks} blocks of {bm.block_size} tokens, "
                f"{bm.num_free_blocks} free>")
