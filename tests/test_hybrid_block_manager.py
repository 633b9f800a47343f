"""The KV cache groups of a hybrid model (chapter 16): one pool, a manager per group.

The main property is checked against a model of the K/V themselves, independent of the
managers: a fake runner writes into every slot a step computes, per group, *what* belongs
there -- (group, the token prefix ending at that position) -- and before each step checks that
every position each new query reads (its whole context in a full-attention group, its last
``w`` positions in a local one) holds exactly that. A block freed too early, a hit on the wrong
group's block, a window searched from the wrong side or a stale table entry all read the wrong
content. Alongside: the pool's invariants after every step, the window bound while decoding,
and every block back in the pool at the end.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from course_pkg.block_manager import BlockManager
from course_pkg.hybrid_block_manager import NULL_BLOCK, HybridBlockManager
from course_pkg.sampling_params import SamplingParams
from course_pkg.scheduler import Scheduler
from course_pkg.sequence import Sequence


def window_bound(w: int, block_size: int) -> int:
    """vLLM's bound: blocks a decoding sequence holds in a group of window ``w``."""
    return -(-(w - 1) // block_size) + 1


def run(seed: int, windows: tuple, block_size: int, num_blocks: int, caching: bool, budget: int,
        num_requests: int = 6, salted: bool = False, swap: bool = False) -> dict:
    """Serve random requests (shared prefixes, n = 1 or 2, readmissions after preemption) through a
    Scheduler on a HybridBlockManager, checking every read against the fake K/V; returns counts."""
    rng = random.Random(seed)
    bm = HybridBlockManager(num_blocks, block_size, windows, enable_prefix_caching=caching, free_queue="linked")
    sched = Scheduler(num_blocks, block_size, block_manager=bm, max_num_batched_tokens=budget,
                      enable_prefix_caching=caching, max_num_seqs=8,
                      preemption_mode="swap" if swap else "recompute", num_cpu_blocks=3 * num_blocks // 4 if swap else None)
    base = [rng.randrange(5) for _ in range(12)]
    for _ in range(num_requests):
        prompt = base[:rng.randrange(1, 12)] + [rng.randrange(5) for _ in range(rng.randrange(1, 10))]
        params = SamplingParams(max_tokens=rng.randrange(1, 25), ignore_eos=True, n=rng.choice([1, 1, 2]))
        salt = rng.choice([None, "a"]) if salted else None
        try:
            sched.add(Sequence(prompt, params, block_size=block_size, cache_salt=salt))
        except ValueError as e:   # a request that could never fit in this pool is refused up front
            assert "can never fit" in str(e)
    kv: dict[tuple[int, int], tuple] = {}   # (block, offset) -> (group, prefix) written there
    cpu: dict[tuple[int, int], tuple] = {}  # the same for the CPU pool of swapping
    windows = (None, *windows)
    counts = dict(reads=0, decodes=0, max_held=[0] * len(windows))
    while not sched.is_finished():
        out = sched.schedule()
        for pairs, source, target in ((out.blocks_to_swap_out, kv, cpu), (out.blocks_to_copy, kv, kv),
                                      (out.blocks_to_swap_in, cpu, kv)):   # the runner's order, before any write
            for src, dst in pairs:
                for o in range(block_size):
                    target.pop((dst, o), None)
                    if (src, o) in source:
                        target[(dst, o)] = source[(src, o)]
        for seq, start, num in zip(out.seqs, out.num_computed_tokens, out.num_scheduled_tokens):
            tables = [seq.block_table, *seq.group_block_tables]
            assert len(tables) == len(windows)
            for g, (table, w) in enumerate(zip(tables, windows)):
                for pos in range(start, start + num):   # the step stores its tokens' K/V ...
                    block = table[pos // block_size]
                    assert block != NULL_BLOCK
                    kv[(block, pos % block_size)] = (g, tuple(seq.token_ids[:pos + 1]))
                for pos in range(start, start + num):   # ... then each query reads its window
                    for q in range(0 if w is None else max(0, pos - w + 1), pos + 1):
                        block = table[q // block_size]
                        assert block != NULL_BLOCK, f"group {g}: position {q} is read but its block was given back"
                        assert kv.get((block, q % block_size)) == (g, tuple(seq.token_ids[:q + 1])), \
                            f"group {g}: position {q} of sequence {seq.seq_id} reads another's K/V"
                        counts["reads"] += 1
                held = sum(1 for b in table if b != NULL_BLOCK)
                counts["max_held"][g] = max(counts["max_held"][g], held)
                if w is not None and num == 1 and start == seq.num_tokens - 1:   # decoding
                    assert held <= window_bound(w, block_size), f"group {g} holds {held} blocks: {table}"
                    counts["decodes"] += 1
        sched.update_from_output(out, [[rng.randrange(5) for _ in range(k)] for k in out.num_samples])
        check_pool(bm)
    assert bm.num_free_blocks == num_blocks and not bm._holders
    counts["hits"] = bm.prefix_cache_stats.hits + bm.prefix_cache_stats.preempted_hits
    counts["preemptions"] = sched.stats.num_preemptions
    counts["swapped_in"] = sched.stats.num_swapped_in
    return counts


def check_pool(bm: HybridBlockManager) -> None:
    """Free and used partition the pool; ref counts sum to the table entries of every group."""
    free = list(bm.free_block_ids)
    assert len(free) == len(set(free)) and set(free).isdisjoint(bm.used_block_ids)
    assert set(free) | bm.used_block_ids == set(range(bm.num_blocks))
    entries = 0
    for seq in bm._holders.values():
        held = seq.block_table + [b for t in seq.group_block_tables for b in t if b != NULL_BLOCK]
        assert len(set(held)) == len(held), "a block is in two tables of one sequence"
        entries += len(held)
    assert sum(b.ref_count for b in bm.blocks) == entries
    for h, block_id in bm.hash_to_block_id.items():
        assert bm.blocks[block_id].hash == h


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10**6),
       windows=st.sampled_from([(8,), (5, None), (1,), (13, 13), (4, 6, 9)]),
       block_size=st.sampled_from([1, 2, 4]),
       num_blocks=st.integers(30, 140),
       caching=st.booleans(), budget=st.sampled_from([5, 16, 64]), salted=st.booleans(), swap=st.booleans())
def test_every_query_reads_its_own_window_and_blocks_come_back(seed, windows, block_size, num_blocks, caching,
                                                               budget, salted, swap):
    run(seed, windows, block_size, num_blocks, caching, budget, salted=salted, swap=swap)


def test_the_runs_exercise_hits_preemptions_and_the_window():
    """The property above is not vacuous: over fixed seeds there are window hits, preemptions,
    decodes in local groups, and local groups that hold fewer blocks than the full one."""
    totals = [run(seed, (8,), 4, 64, True, 16, num_requests=8) for seed in range(12)]
    assert sum(t["hits"] for t in totals) > 0
    assert sum(t["preemptions"] for t in totals) > 0
    assert sum(t["decodes"] for t in totals) > 100
    assert any(t["max_held"][1] < t["max_held"][0] for t in totals)
    swapped = [run(seed, (8,), 4, 36, True, 16, num_requests=8, swap=True) for seed in range(12)]
    assert sum(t["swapped_in"] for t in swapped) > 50 and sum(t["hits"] for t in swapped) > 0


def test_a_window_hit_needs_only_the_window_and_is_searched_from_the_right():
    bm = HybridBlockManager(64, 4, (8,))
    prompt = list(range(3, 27))   # 24 tokens: 6 blocks
    first = Sequence(prompt, block_size=4)
    bm.allocate(first, bm.can_allocate(first))
    local = list(first.group_block_tables[0])
    first.num_cached_tokens = 24
    bm.hash_blocks(first)
    # computed up to 24: a query at 24 reads 17..23, blocks 4 and 5; blocks 0-3 left the window
    assert first.group_block_tables[0] == [NULL_BLOCK] * 4 + local[4:] and len(first.block_table) == 6
    assert all(bm.blocks[b].ref_count == 0 for b in local[:4])   # back in the free queue ...
    bm.deallocate(first)
    bm.forget_overwritten({b: 0 for b in local[:4]})            # ... and now evicted as well
    again = Sequence(prompt + [99], block_size=4)
    assert bm.can_allocate(again) == 6   # the full group has all 6; the window needs only blocks 4-5
    bm.allocate(again, 6)
    assert again.group_block_tables[0] == [NULL_BLOCK] * 4 + local[4:] + again.group_block_tables[0][6:]
    assert again.num_cached_tokens == 24
    bm.deallocate(again)
    bm.forget_overwritten({local[5]: 0})   # block 5 gone too: no point of the prompt has its window cached
    assert bm.can_allocate(Sequence(prompt + [99], block_size=4)) == 0


def test_a_block_of_one_group_never_answers_another_groups_lookup():
    """The same tokens in two groups are two cache entries: the group id is in the chain."""
    bm = HybridBlockManager(64, 4, (8, None))
    seq = Sequence(list(range(3, 15)), block_size=4)
    bm.allocate(seq, 0)
    seq.num_cached_tokens = 12
    bm.hash_blocks(seq)
    registered = [b for b in bm.blocks if b.hash != -1]
    assert len(registered) == 3 + 3 + 3   # 3 full blocks in each of 3 groups (none left the window yet)
    assert len({b.hash for b in registered}) == 9 and len({b.prefix_id for b in registered}) == 9


@pytest.mark.parametrize("windows", [(8,), (3, None)])
def test_a_refused_allocation_changes_nothing(windows):
    bm = HybridBlockManager(10, 4, windows)
    seq = Sequence(list(range(3, 24)), block_size=4)   # 6 blocks in each group: 12 or 18 > 10
    before = (list(bm.free_block_ids), sorted(bm.used_block_ids))
    assert bm.can_allocate(seq) == -1
    with pytest.raises(Exception, match="free blocks|does not fit"):
        bm.allocate(seq, 0)
    assert (list(bm.free_block_ids), sorted(bm.used_block_ids)) == before
    assert seq.block_table == [] and seq.group_block_tables == [] and not bm._holders


def test_a_model_of_full_layers_keeps_the_plain_block_manager():
    from course_pkg.engine.llm_engine import make_block_manager
    from course_pkg.engine.config import EngineConfig
    from course_pkg.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    one = KVCacheConfig((KVCacheGroupSpec((0, 1), FullAttentionSpec(16, 2, 32, 4)),), 2)
    assert type(make_block_manager(8, EngineConfig(), one)) is BlockManager
    with pytest.raises(ValueError, match="at least one group"):
        HybridBlockManager(8, 4, ())
