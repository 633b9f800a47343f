"""Shared test helpers: admitting a sequence, a full copy of a BlockManager's state, its
invariants, an event loop in a thread of its own."""
from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from typing import NamedTuple

from course_pkg import BlockManager, Sequence
from course_pkg.offload import FilterReusedOffloadingManager


def admit(bm: BlockManager, seq, compute: bool = True) -> Sequence:
    """Allocate ``seq`` (a Sequence, or token ids) with every cached block ``can_allocate``
    offers; with ``compute``, then run its prefill step: every token is computed and the
    blocks that became full are registered, as the scheduler's ``update_from_output`` would."""
    if not isinstance(seq, Sequence):
        seq = Sequence(list(seq), block_size=bm.block_size)
    num_cached_blocks = bm.can_allocate(seq)
    assert num_cached_blocks >= 0, "test setup: the sequence does not fit"
    bm.allocate(seq, num_cached_blocks)
    if compute:
        compute_all(bm, seq)
    return seq


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """The model computed every token so far: register the blocks that became full."""
    seq.num_cached_tokens = seq.num_tokens
    bm.hash_blocks(seq)


class ManagerState(NamedTuple):
    """Everything observable about a manager and some sequences' bookkeeping, by value."""

    blocks: tuple           # (block_id, ref_count, hash, token_ids) per block
    free_queue: tuple       # head first
    used: frozenset
    hash_index: tuple       # sorted (hash, block_id) pairs
    cache_stats: tuple      # prefix-cache (requests, queries, hits)
    sequences: tuple        # (block_table, block_hashes, num_cached_tokens, num_tokens) per sequence


def state(bm: BlockManager, seqs=()) -> ManagerState:
    """A copy of the state: equal before and after a call exactly when the call changed nothing.

    Sequence ids are left out, so two managers driven by the same trace (each with its own
    Sequence objects) can be compared too.
    """
    stats = bm.prefix_cache_stats
    return ManagerState(
        blocks=tuple((b.block_id, b.ref_count, b.hash, tuple(b.token_ids)) for b in bm.blocks),
        free_queue=tuple(bm.free_block_ids),
        used=frozenset(bm.used_block_ids),
        hash_index=tuple(sorted(bm.hash_to_block_id.items())),
        cache_stats=(stats.requests, stats.queries, stats.hits),
        sequences=tuple((tuple(s.block_table), tuple(s.block_hashes), s.num_cached_tokens, s.num_tokens)
                        for s in seqs),
    )


def check_invariants(bm: BlockManager, live: list[Sequence], between_steps: bool = False) -> None:
    """The pool's invariants for the sequences that hold blocks (``live``, all of them).

    Free and used partition the pool; a block is free exactly when its ref count is 0 and
    is in the free queue at most once; ref counts sum to the block-table entries of the live
    sequences; every index entry points at a full block carrying that hash. With
    ``live == []`` this says the whole pool is free again. ``between_steps``: a sequence that
    just sampled a token may lack the block for it until the next ``schedule``.
    """
    n = len(bm.blocks)
    free = list(bm.free_block_ids)
    assert len(free) == len(set(free)), "a block is twice in the free queue"
    assert set(free).isdisjoint(bm.used_block_ids), "a block is both free and used"
    assert set(free) | bm.used_block_ids == set(range(n)), "free and used do not cover the pool"
    for b in bm.blocks:
        assert (b.ref_count == 0) == (b.block_id in set(free)), f"block {b.block_id}: ref {b.ref_count} vs free queue"
        assert b.ref_count >= 0
    # (a hybrid model's other KV cache groups hold blocks too: their tables' entries that are not -1)
    entries = sum(len(s.block_table) + sum(1 for t in s.group_block_tables for b in t if b != -1) for s in live)
    assert sum(b.ref_count for b in bm.blocks) == entries, "ref counts do not sum to block-table entries"
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table), "a sequence holds the same block twice"
        if between_steps:
            assert s.num_blocks - 1 <= len(s.block_table) <= s.num_blocks, f"sequence {s.seq_id}'s table"
        else:
            assert len(s.block_table) == s.num_blocks
    for h, bid in bm.hash_to_block_id.items():
        block = bm.blocks[bid]
        assert block.hash == h, f"index entry {h} -> {bid} but block {bid} has hash {block.hash}"
        assert len(block.token_ids) == bm.block_size


def load_build_slides():
    """tools/build_slides.py as a module (tools/ is not a package)."""
    path = Path(__file__).resolve().parents[1] / "tools" / "build_slides.py"
    spec = importlib.util.spec_from_file_location("build_slides", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("build_slides", module)
    spec.loader.exec_module(module)
    return module


def load_lab_solution(name: str):
    """tests/lab_solutions/<name>.py as a module: a student's independent solution of a lab."""
    path = Path(__file__).resolve().parent / "lab_solutions" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"lab_solution_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def results(out, tokens) -> list[list[int]]:
    """Per scheduled sequence of the step ``out``, the list of its sampled tokens, from the short
    form the hand-written tests use: an int (one token), None (a prompt chunk: nothing sampled)
    or a list (the ``n`` first tokens of a forking sequence)."""
    assert len(tokens) == len(out.seqs), "test setup: one result per scheduled sequence"
    return [[] if t is None else list(t) if isinstance(t, list) else [t] for t in tokens]


class Fault:
    """Raise ``exc`` on the ``at``-th call of the wrapped function, once; otherwise call it."""

    def __init__(self, fn, exc, at):
        self.fn, self.exc, self.at, self.calls, self.fired = fn, exc, at, 0, False

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            self.fired = True
            raise self.exc("injected fault")
        return self.fn(*args, **kwargs)


def tier_state(connector) -> tuple:
    """Everything the tier's side of a step may change (chapter 15), by value."""
    m, gate = connector.manager, None
    if isinstance(m, FilterReusedOffloadingManager):
        gate, m = list(m.counts.items()), m.backing
    lists = {name: [(h, None if b is None else (b.block_id, b.ref_cnt)) for h, b in getattr(m, name).items()]
             for name in ("blocks", "t1", "t2", "b1", "b2") if hasattr(m, name)}
    disk = None
    if connector.disk is not None:
        d = connector.disk_manager
        disk = ([(h, b.block_id, b.ref_cnt) for h, b in (d.blocks.items() if hasattr(d, "blocks") else [])],
                list(d.free_block_ids), vars(d.stats).copy(), dict(connector.disk_names), list(connector.writes),
                list(connector.disk_loading))
    return (gate, lists, getattr(m, "p", None), list(m.free_block_ids), vars(m.stats).copy(), dict(connector.names),
            list(connector.stores), dict(connector.storing), list(connector.loading),
            (connector.stats.queries, connector.stats.hits, connector.stats.preempted_hits), disk)


def check_tier(connector) -> None:
    """The tier's invariants between steps: no load in flight; the blocks being stored are
    exactly those of the copies the next step makes; every hash held has its exact name; free
    and held slots partition the tier."""
    m = connector.manager
    m = m.backing if isinstance(m, FilterReusedOffloadingManager) else m
    held = {**m.blocks} if hasattr(m, "blocks") else {**m.t1, **m.t2}
    assert not connector.loading, "a load is still in flight between steps"
    assert all(b.ref_cnt in (0, -1) for b in held.values()), "a tier block is still protected by a load"
    being_stored = {h for h, b in held.items() if b.ref_cnt == -1}
    assert being_stored == set(connector.storing.values())
    assert {slot for _, slot in connector.stores} == set(connector.storing)
    assert all(held[h].block_id == slot for slot, h in connector.storing.items())
    assert set(connector.names) == set(held), "a hash held without its name, or a name without its block"
    slots = [b.block_id for b in held.values()]
    assert sorted(slots + list(m.free_block_ids)) == list(range(m.num_blocks))
    if connector.disk is not None:   # the disk tier: the same rules, and a file for every block written
        d = connector.disk_manager
        on_disk = {**d.blocks} if hasattr(d, "blocks") else {**d.t1, **d.t2}
        assert not connector.disk_loading and all(b.ref_cnt in (0, -1) for b in on_disk.values())
        assert {h for h, b in on_disk.items() if b.ref_cnt == -1} == {h for _, h, _ in connector.writes}
        assert set(connector.disk_names) == set(on_disk)
        ready = [h for h, b in on_disk.items() if b.ref_cnt == 0]
        assert all(connector.disk.file(h).exists() for h in ready), "a block the disk tier holds has no file"


def run_in_fresh_loop(coro):
    """``asyncio.run(coro)`` in a thread of its own. The browser tests' Playwright (session-scoped,
    on the same xdist worker when the scheduling puts them there) keeps an event loop marked as
    running in the main thread, and ``asyncio.run`` refuses to start beside one."""
    import threading

    result = {}

    def target():
        try:
            result["value"] = asyncio.run(coro)
        except BaseException as e:       # handed to the test's thread, as asyncio.run would raise it
            result["error"] = e

    thread = threading.Thread(target=target, name="test-event-loop")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result.get("value")
