"""Run a student's BlockManager and the package's side by side, call by call.

``Lockstep`` holds two managers -- the reference and the one under test -- and a pair of
sequences per name (same tokens, one for each manager). Every call goes to both. After it,
the grader compares what the call returned (or whether it raised), then the observable state
of the two managers, field by field, and checks the contract's invariants on the manager
under test. Only public calls and public state are used: ``blocks`` (ref count, hash, token
ids), ``free_block_ids`` (in order), ``used_block_ids``, ``hash_to_block_id`` and each
sequence's ``block_table`` and ``num_cached_tokens``. (One private record, the manager's list
of the sequences it holds, is kept in step around a student's calls: ``hooks.keep_private_guards``.)

``expect`` compares the manager under test with a value computed by hand from the contract
(ARCHITECTURE.md, "The contract of the core"), not taken from the reference.
"""
from __future__ import annotations

from contextlib import contextmanager
from itertools import islice
from typing import Callable

from course_pkg.block_manager import BlockManager
from course_pkg.labs.hooks import keep_private_guards
from course_pkg.labs.lab import Grading
from course_pkg.sequence import Sequence


def bounded(items, limit: int) -> tuple:
    """At most ``limit`` items of ``items``: a corrupt linked queue may iterate forever."""
    return tuple(islice(iter(items), limit))


def manager_state(bm: BlockManager, seqs: dict[str, Sequence]) -> dict[str, object]:
    """The observable state, by value, as named fields (compared in this order)."""
    state: dict[str, object] = {
        "free queue (head first)": bounded(bm.free_block_ids, len(bm.blocks) + 1),
        "used blocks": tuple(sorted(bm.used_block_ids)),
        "ref counts": tuple(b.ref_count for b in bm.blocks),
        "hash index (block ids)": tuple(sorted(bm.hash_to_block_id.values())),
        "hash index": tuple(sorted(bm.hash_to_block_id.items())),
        "block hashes": tuple(b.hash for b in bm.blocks),
        "block token ids": tuple(tuple(b.token_ids) for b in bm.blocks),
    }
    for name, seq in seqs.items():
        state[f"block table of {name}"] = tuple(seq.block_table)
        state[f"num_cached_tokens of {name}"] = seq.num_cached_tokens
        state[f"block_hashes of {name}"] = tuple(seq.block_hashes)
    return state


def invariant_violations(bm: BlockManager, live: list[Sequence]) -> list[str]:
    """The contract's invariants that ``bm`` breaks (empty when all hold)."""
    problems = []
    n = len(bm.blocks)
    free = list(bounded(bm.free_block_ids, n + 1))
    free_set = set(free)
    if len(free) != len(free_set):
        problems.append("a block is in the free queue twice")
    if not free_set.isdisjoint(bm.used_block_ids):
        problems.append(f"blocks {sorted(free_set & bm.used_block_ids)} are both free and used")
    if free_set | set(bm.used_block_ids) != set(range(n)):
        problems.append("the free queue and the used set do not cover the pool")
    for b in bm.blocks:
        if (b.ref_count == 0) != (b.block_id in free_set):
            problems.append(f"block {b.block_id} has ref_count {b.ref_count} but is "
                            f"{'in' if b.block_id in free_set else 'not in'} the free queue")
            break
    entries = sum(len(s.block_table) for s in live)
    total = sum(b.ref_count for b in bm.blocks)
    if total != entries:
        problems.append(f"ref counts sum to {total} but live block tables hold {entries} entries")
    for s in live:
        if len(set(s.block_table)) != len(s.block_table):
            problems.append(f"a sequence holds the same block twice: {s.block_table}")
    for h, block_id in bm.hash_to_block_id.items():
        if not 0 <= block_id < n:
            problems.append(f"index entry {h} points at block {block_id}, outside the pool")
        elif bm.blocks[block_id].hash != h:
            problems.append(f"index entry {h} -> block {block_id}, but block {block_id} has hash "
                            f"{bm.blocks[block_id].hash} (a stale entry)")
            break
    return problems


class Named:
    """An argument that names a sequence: each manager gets its own Sequence of that name."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _call(fn: Callable, *args):
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001 -- misuse must raise; which exception is the code's choice
        return None, e


class Lockstep:
    """The reference manager and the one under test, driven by the same calls."""

    def __init__(self, g: Grading, impl: type, num_blocks: int, block_size: int,
                 reference: type = BlockManager, **kwargs):
        self.g = g
        self.block_size = block_size
        self.ref = reference(num_blocks, block_size, **kwargs)
        self.mine = keep_private_guards(impl)(num_blocks, block_size, **kwargs)
        self.ref_seqs: dict[str, Sequence] = {}
        self.my_seqs: dict[str, Sequence] = {}

    # ------------------------------------------------------------------ sequences

    def seq(self, name: str, token_ids: list[int], cache_salt: str | None = None) -> None:
        """A new request named ``name`` (one Sequence per manager), with ``cache_salt`` if given."""
        self.ref_seqs[name] = Sequence(list(token_ids), block_size=self.block_size, cache_salt=cache_salt)
        self.my_seqs[name] = Sequence(list(token_ids), block_size=self.block_size, cache_salt=cache_salt)

    def append_token(self, name: str, token_id: int) -> None:
        """A decode step sampled ``token_id`` for ``name`` (no manager call)."""
        self.ref_seqs[name].append_token(token_id)
        self.my_seqs[name].append_token(token_id)

    def computed(self, name: str, num_tokens: int | None = None) -> None:
        """A step wrote the K/V of ``name``'s tokens up to ``num_tokens`` (all by default),
        then registers the blocks that became full: what ``Scheduler.update_from_output`` does."""
        for seq in (self.ref_seqs[name], self.my_seqs[name]):
            seq.num_cached_tokens = seq.num_tokens if num_tokens is None else num_tokens
        self.call("hash_blocks", name)

    # ------------------------------------------------------------------ calls

    def fork(self, parent: str, child: str, *, expect_raise: bool | None = None) -> None:
        """``fork(parent, child)`` on both managers, ``child`` a fresh copy (``Sequence.fork``)."""
        self.ref_seqs[child] = self.ref_seqs[parent].fork(len(self.ref_seqs))
        self.my_seqs[child] = self.my_seqs[parent].fork(len(self.my_seqs))
        self.call("fork", parent, Named(child), expect_raise=expect_raise)

    def call(self, method: str, name: str, *args, expect_raise: bool | None = None,
             compare_result: bool = False):
        """``method(seq, *args)`` on both managers; compare results, state and invariants.

        The results of ``can_allocate`` and ``can_append`` are always compared, others only with
        ``compare_result`` (``may_append``'s copy-on-write copies, in the fork lab). A ``Named``
        argument stands for that sequence.
        """
        label = f"{method}({', '.join([name, *map(repr, args)])})"
        before = manager_state(self.mine, self.my_seqs)
        ref_args = [self.ref_seqs[a.name] if isinstance(a, Named) else a for a in args]
        my_args = [self.my_seqs[a.name] if isinstance(a, Named) else a for a in args]
        ref_result, ref_error = _call(getattr(self.ref, method), self.ref_seqs[name], *ref_args)
        my_result, my_error = _call(getattr(self.mine, method), self.my_seqs[name], *my_args)
        if expect_raise is not None and (ref_error is not None) != expect_raise:
            raise AssertionError(f"the reference disagrees with the lab about whether {label} raises "
                                 f"({ref_error!r}): the lab needs updating")
        if ref_error is not None:
            if my_error is None:
                self.g.fail(f"{label} must raise ({type(ref_error).__name__}: {ref_error}) "
                            f"but returned {my_result!r}")
            if isinstance(my_error, NotImplementedError):
                self.g.fail(f"{label} raised NotImplementedError: {my_error}")
            after = manager_state(self.mine, self.my_seqs)
            changed = [k for k in before if before[k] != after[k]]
            self.g.check(not changed, f"{label} raised as it must, but changed {', '.join(changed)}: "
                                      "misuse must leave the state untouched")
            return None
        if my_error is not None:
            self.g.fail(f"{label} raised {type(my_error).__name__}: {my_error}")
        if compare_result or method in ("can_allocate", "can_append"):
            self.g.equal(my_result, ref_result, f"{label} returned")
        self.compare(label)
        return my_result

    def compare(self, label: str) -> None:
        """The state of the manager under test equals the reference's; invariants hold."""
        problems = invariant_violations(self.mine, [s for s in self.my_seqs.values() if s.block_table])
        if problems:
            self.g.fail(f"after {label}: invariant broken: {problems[0]}")
        ref_state = manager_state(self.ref, self.ref_seqs)
        my_state = manager_state(self.mine, self.my_seqs)
        for key, expected in ref_state.items():
            if my_state[key] != expected:
                self.g.fail(f"after {label}: {key} differs: expected {_short(expected)}, "
                            f"got {_short(my_state[key])}")

    def expect(self, key: str, value, why: str) -> None:
        """A hand-computed expectation from the contract, checked on both managers."""
        ref_value = manager_state(self.ref, self.ref_seqs)[key]
        if ref_value != value:
            raise AssertionError(f"the reference breaks the lab's expectation {key} == {value!r} "
                                 f"({why}); got {ref_value!r}: the lab needs updating")
        got = manager_state(self.mine, self.my_seqs)[key]
        self.g.check(got == value, f"{key}: expected {_short(value)} ({why}), got {_short(got)}")

    @contextmanager
    def patched_hash(self, fn: Callable[[list[int], int], int]):
        """Replace ``compute_hash`` on both managers (to force collisions)."""
        import course_pkg.block_manager as bm_module

        saved = bm_module.compute_hash
        for bm in (self.ref, self.mine):
            bm.compute_hash = fn
        bm_module.compute_hash = fn
        try:
            yield
        finally:
            bm_module.compute_hash = saved
            for bm in (self.ref, self.mine):
                del bm.compute_hash


def _short(value, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def random_trace(lock: Lockstep, seed: int, steps: int, *, decode: bool = True, forks: bool = False,
                 salts: tuple = (None,)) -> None:
    """``steps`` seeded random legal calls on both managers, compared after each one.

    Prompts share a random part of one "system prompt" and end in tokens drawn from a tiny
    vocabulary (so whole blocks repeat after different prefixes); admitted prompts are computed
    at once; running sequences decode (or, without a free block, are released as a scheduler
    would preempt them); some finish and are released; with ``forks``, running sequences fork
    (and their copy-on-write copies are compared); each new request takes one of ``salts`` as
    its ``cache_salt``. Decisions follow the managers' answers, which the lockstep has already
    checked to be equal.
    """
    import random

    rng = random.Random(seed)
    bs = lock.block_size
    system = [rng.randrange(1, 1000) for _ in range(3 * bs)]
    live: list[str] = []
    for n in range(steps):
        r = rng.random()
        if r < 0.3 or not live:
            name = f"S{n}"
            tokens = system[:rng.randrange(0, len(system) + 1)]
            tokens += [rng.randrange(1000, 1003) for _ in range(rng.randrange(1, 2 * bs + 1))]
            lock.seq(name, tokens, rng.choice(salts) if len(salts) > 1 else salts[0])
            hits = lock.call("can_allocate", name)
            if hits >= 0:
                # Sometimes fewer hits than found: more fresh blocks, which may not fit (then
                # both managers must refuse, changing nothing).
                lock.call("allocate", name, rng.randrange(0, hits + 1) if rng.random() < 0.2 else hits)
                if lock.ref_seqs[name].block_table:
                    lock.computed(name)
                    live.append(name)
        elif forks and r < 0.4:
            child = f"S{n}"
            lock.fork(rng.choice(live), child)
            live.append(child)
        elif r < 0.85 and decode:
            name = rng.choice(live)
            lock.append_token(name, rng.randrange(1000, 1003))
            if lock.call("can_append", name):
                lock.call("may_append", name, compare_result=forks)
                lock.computed(name)
            else:
                lock.call("deallocate", name)
                live.remove(name)
        else:
            name = live.pop(rng.randrange(len(live)))
            lock.call("deallocate", name)
