"""The journal on its own (ARCHITECTURE.md, "The journal").

* Journaled containers: any sequence of changes to a list, deque, dict, set or array, rolled
  back, gives back exactly the contents before (a property test against copies made
  beforehand), and running the inverses a second time changes nothing (so a rollback cut short
  can simply run again).
* The block manager: any sequence of its calls inside ``transaction(...)``, broken off by an
  exception at any point, leaves every structure as it was -- ref counts, the free queue's
  order (deque and linked), the used set, the prefix index, the exact prefix ids, the owners,
  the statistics and every sequence's block table.
* Plain code is journaled without knowing it: a student's ``allocate``, ``deallocate``, ``fork``
  (the independent solutions in tests/lab_solutions/) and ``preempt``, interrupted at every
  one of their lines, leave the state exactly as before.
* ``forget_overwritten``: after K/V were written, the written blocks lose their cache entries
  and exactly the holders whose computed tokens were hit are reported.
"""
from __future__ import annotations

import copy
import sys
from array import array
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_pkg import BlockManager, Scheduler, Sequence
from course_pkg.scheduler import STEP_STATE
from course_pkg.sequence import SequenceStatus
from course_pkg.undo import Journal, transaction
from tests.helpers import check_invariants, load_lab_solution, results


class Boom(Exception):
    pass


class Box:
    pass


CONTAINER_OPS = st.lists(st.tuples(st.sampled_from(
    ["l.append", "l.extend", "l.insert", "l.pop", "l.remove", "l.set", "l.del", "l.slice", "l.clear", "l.sort",
     "q.append", "q.appendleft", "q.pop", "q.popleft", "q.remove", "q.insert", "q.extend", "q.rotate",
     "b.append", "d.set", "d.del", "d.pop", "d.update", "d.setdefault", "s.add", "s.discard", "s.remove",
     "s.update", "s.pop", "a.set"]), st.integers(0, 5), st.integers(0, 9)), max_size=40)


def container_state(box) -> tuple:
    return (list(box.items), list(box.queue), list(box.bounded), dict(box.table), set(box.members),
            list(box.links), box.counter)


def apply_container_op(box, op: str, i: int, v: int) -> None:
    items, queue, table, members = box.items, box.queue, box.table, box.members
    if op == "l.append":
        items.append(v)
    elif op == "l.extend":
        items.extend([v, v + 1])
    elif op == "l.insert":
        items.insert(i, v)
    elif op == "l.pop" and items:
        items.pop(i % len(items))
    elif op == "l.remove" and v in items:
        items.remove(v)
    elif op == "l.set" and items:
        items[i % len(items)] = v
    elif op == "l.del" and items:
        del items[i % len(items):]
    elif op == "l.slice":
        items[:i] = [v] * 2
    elif op == "l.clear":
        items.clear()
    elif op == "l.sort":
        items.sort(reverse=bool(i % 2))
    elif op == "q.append":
        queue.append(v)
    elif op == "q.appendleft":
        queue.appendleft(v)
    elif op == "q.pop" and queue:
        queue.pop()
    elif op == "q.popleft" and queue:
        queue.popleft()
    elif op == "q.remove" and v in queue:
        queue.remove(v)
    elif op == "q.insert":
        queue.insert(i, v)
    elif op == "q.extend":
        queue.extend([v, i])
    elif op == "q.rotate":
        queue.rotate(i)
    elif op == "b.append":
        box.bounded.append(v)          # a bounded deque: full ones drop their head
    elif op == "d.set":
        table["abcdef"[i]] = v
    elif op == "d.del" and table:
        del table[sorted(table)[i % len(table)]]
    elif op == "d.pop":
        table.pop("abcdef"[i], None)
    elif op == "d.update":
        table.update({"x": v, "a": i})
    elif op == "d.setdefault":
        table.setdefault("abcdef"[i], v)
    elif op == "s.add":
        members.add(v)
    elif op == "s.discard":
        members.discard(v)
    elif op == "s.remove" and v in members:
        members.remove(v)
    elif op == "s.update":
        members.update({v, i})
    elif op == "s.pop" and members:
        members.pop()
    elif op == "a.set":
        box.links[i] = v
    box.counter += 1


@settings(max_examples=200, deadline=None)
@given(CONTAINER_OPS)
def test_every_container_change_rolled_back_gives_back_the_contents_before(ops):
    box = Box()
    box.items, box.queue, box.bounded = [1, 2, 3], deque([4, 5]), deque([7, 8, 9], maxlen=3)
    box.table, box.members, box.links, box.counter = {"a": 1}, {1, 2}, array("q", range(6)), 0
    journal = Journal(follow=(Box,))
    journal.adopt(box)
    before = container_state(box)
    journal.begin()
    for op in ops:
        apply_container_op(box, *op)
    saved = list(journal._log)
    journal.rollback()
    assert container_state(box) == before and len(journal) == 0 and not journal.recording
    # A rollback interrupted after an inverse ran, but before it left the log, runs it again.
    for twice in range(len(saved)):
        replay = Box()
        replay.items, replay.queue, replay.bounded = [1, 2, 3], deque([4, 5]), deque([7, 8, 9], maxlen=3)
        replay.table, replay.members, replay.links, replay.counter = {"a": 1}, {1, 2}, array("q", range(6)), 0
        journal.adopt(replay)
        journal.begin()
        for op in ops:
            apply_container_op(replay, *op)
        log = list(journal._log)
        journal.commit()
        for j in range(len(log) - 1, -1, -1):
            undo, *args = log[j]
            undo(*args)
            if j == twice:
                undo(*args)
        assert container_state(replay) == before


def test_adopted_objects_keep_their_names_reprs_and_contents():
    bm = BlockManager(6, 2)
    seq = Sequence([1, 2, 3], block_size=2)
    bm.allocate(seq, 0)
    text = (repr(bm.free_block_ids), repr(seq), repr(bm.blocks[0]), repr(bm.used_block_ids))
    Journal(follow=STEP_STATE).adopt(bm)
    assert (repr(bm.free_block_ids), repr(seq), repr(bm.blocks[0]), repr(bm.used_block_ids)) == text
    assert type(seq).__name__ == "Sequence" and isinstance(bm.blocks[0], type(BlockManager(1, 1).blocks[0]))
    assert seq.block_table == [0, 1] and copy.deepcopy(seq).block_table == [0, 1]


def full_state(bm: BlockManager, seqs) -> tuple:
    stats = bm.prefix_cache_stats
    return (
        tuple((b.block_id, b.ref_count, b.hash, tuple(b.token_ids), b.prefix_id, b.parent_prefix_id, b.cache_salt)
              for b in bm.blocks),
        tuple(bm.free_block_ids), frozenset(bm.used_block_ids), tuple(sorted(bm.hash_to_block_id.items())),
        tuple(sorted(bm._prefix_ids.items(), key=repr)), bm._next_prefix_id, tuple(sorted(bm._holders)),
        (stats.requests, stats.queries, stats.hits, stats.preempted_requests, tuple(stats.recent)),
        tuple((s.seq_id, tuple(s.block_table), tuple(s.block_hashes), s.num_cached_tokens, tuple(s.token_ids),
               s.num_tokens) for s in seqs),
    )


OPS = st.lists(st.tuples(st.sampled_from(["allocate", "deallocate", "fork", "hash", "append"]),
                         st.integers(0, 7), st.integers(1, 9)), min_size=1, max_size=25)


def apply(bm: BlockManager, seqs: list[Sequence], op: str, i: int, v: int) -> None:
    """One block-manager call chosen by (op, i, v); calls that do not apply are skipped."""
    held = [s for s in seqs if s.block_table]
    if op == "allocate":
        prompt = ([1, 2, 3, 4, 5, 6] * 3)[: 2 + i * 2] + [v]   # shared prefixes: hits and revivals
        seq = Sequence(prompt, block_size=bm.block_size)
        n = bm.can_allocate(seq)
        if n >= 0:
            bm.allocate(seq, n)
            seqs.append(seq)
    elif op == "deallocate" and held:
        bm.deallocate(held[i % len(held)])
    elif op == "fork" and held:
        parent = held[i % len(held)]
        child = parent.fork(1)
        bm.fork(parent, child)
        seqs.append(child)
    elif op == "hash" and held:
        seq = held[i % len(held)]
        seq.num_cached_tokens = seq.num_tokens - (v % 2)
        bm.hash_blocks(seq)
    elif op == "append" and held:
        seq = held[i % len(held)]
        seq.append_token(v)
        if bm.can_append(seq):
            bm.may_append(seq)
        else:                 # no block for it: the token is taken back (a scheduler would preempt)
            seq.token_ids.pop()
            seq.num_tokens -= 1


@settings(max_examples=150, deadline=None)
@given(warm=OPS, ops=OPS, fail_at=st.integers(0, 25), queue=st.sampled_from(["deque", "linked"]))
def test_a_transaction_broken_off_anywhere_leaves_the_manager_as_it_was(warm, ops, fail_at, queue):
    bm = BlockManager(14, 2, free_queue=queue)
    seqs: list[Sequence] = []
    for op in warm:                       # some history: held, shared, registered and freed blocks
        apply(bm, seqs, *op)
    before = full_state(bm, seqs)
    known = list(seqs)
    with pytest.raises(Boom):
        with transaction(bm, *seqs, follow=STEP_STATE):
            for k, op in enumerate(ops):
                if k == fail_at % len(ops):
                    raise Boom
                apply(bm, seqs, *op)
    assert full_state(bm, known) == before
    check_invariants(bm, [s for s in known if s.block_table])
    with transaction(bm, *known):         # the manager goes on working, and commits
        for op in ops:
            apply(bm, known, *op)
    check_invariants(bm, [s for s in known if s.block_table])


@settings(max_examples=100, deadline=None)
@given(rounds=st.lists(st.tuples(OPS, st.integers(0, 25), st.booleans(), st.sampled_from(["", "between", "inside"])),
                      min_size=2, max_size=6),
       queue=st.sampled_from(["deque", "linked"]))
def test_transaction_after_transaction_each_undone_or_committed_exactly(rounds, queue):
    """An engine runs transaction after transaction over the same objects: each of such a run,
    committed or broken off, is undone exactly -- also when a held sequence was given new
    plain lists, between two transactions or inside one (the journal must enrol them before
    a later transaction changes them)."""
    bm = BlockManager(14, 2, free_queue=queue)
    seqs: list[Sequence] = []

    def new_lists():   # plain lists where journaled ones were
        for seq in seqs:
            seq.num_preemptions = seq.num_preemptions   # (inside: a first change comes before them)
            seq.block_hashes = list(seq.block_hashes)
            seq.token_ids = list(seq.token_ids)

    for ops, fail_at, fails, when in rounds:
        if when == "between":
            new_lists()
        before, known = full_state(bm, seqs), list(seqs)
        try:
            with transaction(bm, *seqs, follow=STEP_STATE):
                if when == "inside":
                    new_lists()
                for k, op in enumerate(ops):
                    if fails and k == fail_at % len(ops):
                        raise Boom
                    apply(bm, seqs, *op)
        except Boom:
            assert full_state(bm, known) == before
            seqs = known
        check_invariants(bm, [s for s in seqs if s.block_table])
    before = full_state(bm, seqs)   # last, every sequence's lists are changed in a transaction that fails
    with pytest.raises(Boom):
        with transaction(bm, *seqs, follow=STEP_STATE):
            for seq in seqs:
                seq.token_ids.append(0)
                seq.block_hashes.append(0)
            raise Boom
    assert full_state(bm, seqs) == before


class Tensorish:
    """A value whose ``==`` raises unless it is compared with itself (as a torch tensor's does)."""

    def __eq__(self, other):
        if other is self:
            return True
        raise RuntimeError("the truth value of a comparison is ambiguous")

    __hash__ = object.__hash__


def test_a_field_whose_comparison_raises_is_undone_and_does_not_break_the_journal():
    """The journal puts values back by identity: a value whose ``==`` raises (a tensor) in a
    field of an enrolled object is undone like any other, transaction after transaction."""
    box = Box()
    box.value, box.items = Tensorish(), [1]
    first = box.value
    journal = Journal(follow=(Box,))
    journal.adopt(box)
    for _ in range(3):   # committed
        with transaction(box):
            box.value = Tensorish()
            box.items.append(2)
    kept, items = box.value, list(box.items)
    with pytest.raises(Boom):
        with transaction(box):
            box.value = first
            box.items.append(3)
            raise Boom
    assert box.value is kept and box.items == items
    with transaction(box):   # and the journal goes on
        box.items.append(4)
    assert box.items == items + [4]


# ---------------------------------------------------------------- plain code, interrupted at any line

class LineFault:
    """``with LineFault(code_objects, k):`` raises KeyboardInterrupt before the k-th line that
    runs in one of those functions; ``fired`` says whether it came to that."""

    def __init__(self, codes, k: int):
        self.codes, self.k, self.lines, self.fired = set(codes), k, 0, False

    def _trace(self, frame, event, arg):
        if frame.f_code not in self.codes:
            return None
        return self._line

    def _line(self, frame, event, arg):
        if event == "line":
            self.lines += 1
            if self.lines == self.k:
                self.fired = True
                raise KeyboardInterrupt("injected at a line")
        return self._line

    def __enter__(self):
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        return False


def codes_of(cls, *names):
    return [getattr(cls, n).__code__ for n in names]


def interrupt_every_line(make, call, codes, observe):
    """For k = 1, 2, ...: build a fresh world (``make``), run ``call`` inside a transaction
    with a KeyboardInterrupt before its k-th line (in ``codes``), and check that ``observe``
    sees the world as before; stop once the call runs to its end. Returns how many lines."""
    k = 0
    while True:
        k += 1
        world = make()
        before = observe(world)
        fault = LineFault(codes, k)
        try:
            with transaction(*world["roots"], follow=STEP_STATE):
                with fault:
                    call(world)
        except KeyboardInterrupt:
            pass
        if not fault.fired:
            return k - 1
        assert observe(world) == before, f"interrupted before line {k}: the state changed"
        check_invariants(world["bm"], [s for s in world["seqs"] if s.block_table])


def warm_world(manager_cls, queue):
    bm = manager_cls(10, 2, free_queue=queue)
    seqs = []
    for prompt in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 9], [7, 7, 7]):   # shared blocks, cached and free ones
        seq = Sequence(prompt, block_size=2)
        BlockManager.allocate(bm, seq, bm.can_allocate(seq))   # (the package's: the student's skips its guard)
        seq.num_cached_tokens = seq.num_tokens
        bm.hash_blocks(seq)
        seqs.append(seq)
    BlockManager.deallocate(bm, seqs.pop())   # [7, 7, 7]'s blocks: free, one still cached
    return bm, seqs


@pytest.mark.parametrize("queue", ["deque", "linked"])
def test_a_students_plain_allocate_and_deallocate_interrupted_at_any_line_change_nothing(queue):
    student = load_lab_solution("allocate").ScratchAllocateBlockManager
    codes = codes_of(student, "allocate", "deallocate") + codes_of(BlockManager, "_allocate_block",
                                                                    "_maybe_evict_cached_block", "_match_prefix")

    def make():
        bm, seqs = warm_world(student, queue)
        new = Sequence([1, 2, 3, 4, 7, 7, 8], block_size=2)     # hits two blocks, revives a free one
        return {"bm": bm, "seqs": seqs + [new], "roots": [bm, *seqs, new], "new": new}

    def call(world):
        bm = world["bm"]
        bm.allocate(world["new"], bm.can_allocate(world["new"]))
        bm.deallocate(world["seqs"][0])

    lines = interrupt_every_line(make, call, codes, lambda w: full_state(w["bm"], w["seqs"]))
    assert lines > 30


def test_a_students_plain_fork_and_copy_on_write_interrupted_at_any_line_change_nothing():
    student = load_lab_solution("fork_cow").ScratchForkBlockManager

    def make():
        bm, seqs = warm_world(student, "linked")
        child = seqs[0].fork(1)
        return {"bm": bm, "seqs": seqs + [child], "roots": [bm, *seqs, child], "child": child}

    def call(world):
        bm, parent, child = world["bm"], world["seqs"][0], world["child"]
        bm.fork(parent, child)
        bm._holders[child.seq_id] = child     # (the package's guard; the lab leaves it out)
        child.append_token(5)
        bm.may_append(child)                  # the shared partial block is copied

    lines = interrupt_every_line(make, call, codes_of(student, "fork", "may_append"),
                                 lambda w: full_state(w["bm"], w["seqs"]))
    assert lines > 10


class PlainPreemptScheduler(Scheduler):
    """A student's ``preempt`` by recompute, written without a thought for the journal."""

    def preempt(self, seq, plan):
        self.block_manager.deallocate(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_scheduled_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.stats.num_preemptions += 1
        plan.preempted.append(seq)


def scheduler_state(sched) -> tuple:
    live = list(sched.waiting) + list(sched.running)
    return (tuple(s.seq_id for s in sched.waiting), tuple(s.seq_id for s in sched.running),
            tuple((s.status, s.num_scheduled_tokens, s.num_preemptions) for s in live),
            sched.stats.num_preemptions, sched.journal.recording, full_state(sched.block_manager, live))


def preempting_scheduler(warm_steps: int | None):
    """Two requests fill a pool of 6 blocks; a third waits. After ``warm_steps`` steps (None: as
    many as run before the first step that preempts), returns the scheduler and that count."""
    from course_pkg import SamplingParams

    sched = PlainPreemptScheduler(6, 2, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(3):
        sched.add(Sequence([1, 2, 3, 4, 5 + i], params, block_size=2))
    steps = 0
    while warm_steps is None or steps < warm_steps:
        out = sched.schedule()
        if warm_steps is None and out.preempted:
            sched.unschedule(out)
            return sched, steps
        sched.update_from_output(out, results(out, [3] * len(out.seqs)))
        steps += 1
    return sched, steps


def test_a_students_plain_preempt_interrupted_at_any_line_is_undone_with_its_step():
    codes = codes_of(PlainPreemptScheduler, "preempt") + codes_of(BlockManager, "deallocate", "_deallocate_block")
    _, warm = preempting_scheduler(None)
    k = 0
    while True:
        k += 1
        sched, _ = preempting_scheduler(warm)
        before = scheduler_state(sched)
        fault = LineFault(codes, k)
        try:
            with fault:
                out = sched.schedule()
        except KeyboardInterrupt:
            assert scheduler_state(sched) == before, f"interrupted before line {k}: the state changed"
            out = sched.schedule()                    # the same step, now without a fault
        assert out.preempted
        sched.update_from_output(out, results(out, [3] * len(out.seqs)))
        if not fault.fired:
            break
    assert k > 8


def test_forget_overwritten_drops_the_written_blocks_entries_and_names_the_damaged_holders():
    bm, seqs = warm_world(BlockManager, "linked")
    cached_free = [b.block_id for b in bm.blocks if b.ref_count == 0 and b.hash != -1]
    shared = seqs[0].block_table[0]                   # computed, registered, held by both
    own_partial = seqs[0].block_table[-1]             # 1 computed token; slot 1 is past it
    written = {cached_free[0]: 0, shared: 1, own_partial: 1}
    damaged = bm.forget_overwritten(written)
    assert damaged == seqs                            # both hold the shared block's computed slot 1
    assert bm.blocks[cached_free[0]].hash == -1 and cached_free[0] not in bm.hash_to_block_id.values()
    assert bm.blocks[shared].hash == -1
    assert bm.forget_overwritten({own_partial: 1}) == []   # writing past a sequence's computed tokens harms nobody
    check_invariants(bm, seqs)


def test_deferred_interrupts_hold_a_sigint_until_the_block_ends():
    import signal
    import threading

    from course_pkg.undo import deferred_interrupts

    ran = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            signal.raise_signal(signal.SIGINT)
            ran.append("the rest of the block")
    assert ran == ["the rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # the handler is back
    with deferred_interrupts():   # nothing held: nothing raised
        ran.append("quiet")
    errors = []

    def in_a_thread():   # signals reach the main thread only: there it changes nothing
        try:
            with deferred_interrupts():
                errors.append(signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        except BaseException as e:
            errors.append(e)
    t = threading.Thread(target=in_a_thread)
    t.start()
    t.join()
    assert errors == [True]
