"""Workload generators and the model-free simulator.

The simulator is checked against an independent reference: with a pool too large to evict
anything and one request at a time, the prefix-cache hits of each request are exactly the
leading full blocks of its prompt that earlier requests computed -- which a set of token
prefixes computes without any BlockManager.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_pkg import BlockManager, Sequence
from course_pkg.workloads import (ForwardReleaseBlockManager, Request, Simulator, make_block_manager,
                                  multi_turn_workload, random_workload, shared_prefix_workload, simulate)


# ------------------------------------------------------------------ generators

def test_generators_are_deterministic_per_seed():
    for make in (lambda s: shared_prefix_workload(50, seed=s), lambda s: multi_turn_workload(5, 3, seed=s),
                 lambda s: random_workload(50, seed=s)):
        assert make(1) == make(1)
        assert make(1) != make(2)


def test_shared_prefix_requests_start_with_one_of_the_prompts():
    reqs = shared_prefix_workload(300, num_prefixes=4, prefix_len=40, suffix_len=(3, 9), output_len=5, seed=0)
    prefixes = {r.prompt_token_ids[:40] for r in reqs}
    assert len(prefixes) == 4
    assert all(3 <= len(r.prompt_token_ids) - 40 <= 9 and len(r.output_token_ids) == 5 for r in reqs)
    # Zipf popularity: prompt 0 is the most frequent.
    counts = {tag: sum(r.tag == tag for r in reqs) for tag in {r.tag for r in reqs}}
    assert max(counts, key=counts.get) == "prefix 0"


def test_multi_turn_prompt_holds_previous_turn_and_answer():
    reqs = multi_turn_workload(3, 4, system_len=10, user_len=5, output_len=7, seed=0)
    assert len(reqs) == 12
    for i, r in enumerate(reqs):
        if i < 3:
            assert r.parent is None
        else:
            parent = reqs[r.parent]
            assert r.parent == i - 3
            history = parent.prompt_token_ids + parent.output_token_ids
            assert r.prompt_token_ids[:len(history)] == history
            assert len(r.prompt_token_ids) == len(history) + 5


def test_request_validation():
    with pytest.raises(ValueError, match="prompt"):
        Request((), (1,))
    with pytest.raises(ValueError, match="decode"):
        Request((1,), ())


# ------------------------------------------------------------------ the simulator

def _reference_hits(requests: list[Request], block_size: int) -> list[int]:
    """Hits in tokens per request, served one at a time from a cache that never evicts."""
    computed: set[tuple[int, ...]] = set()  # token prefixes ending at a computed full block
    hits = []
    for r in requests:
        prompt = r.prompt_token_ids
        n = 0
        while n < (len(prompt) - 1) // block_size and prompt[:(n + 1) * block_size] in computed:
            n += 1
        hits.append(n * block_size)
        # Every token but the last decoded one has K/V when the request finishes.
        tokens = prompt + r.output_token_ids[:-1]
        for b in range(len(tokens) // block_size):
            computed.add(tokens[:(b + 1) * block_size])
    return hits


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_hits_match_an_independent_reference_without_eviction(block_size):
    requests = (shared_prefix_workload(40, num_prefixes=3, prefix_len=37, suffix_len=(1, 20),
                                       output_len=(1, 9), seed=block_size)
                + multi_turn_workload(4, 3, system_len=20, user_len=(1, 7), output_len=(1, 12), seed=5))
    total = sum(r.num_tokens for r in requests)
    result = simulate(requests, num_blocks=total, block_size=block_size, max_num_seqs=1)
    expected = _reference_hits(requests, block_size)
    assert result.prefix_cache_hits == sum(expected)
    assert result.prefix_cache_queries == sum(len(r.prompt_token_ids) for r in requests)
    assert result.num_preemptions == 0
    assert result.num_computed_tokens == result.prefix_cache_queries - result.prefix_cache_hits


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(12, 60), block_size=st.integers(1, 4),
       max_num_seqs=st.integers(1, 6), release=st.sampled_from(["reversed", "forward"]))
def test_every_request_finishes_with_its_tokens_and_the_pool_is_whole_again(
        seed, num_blocks, block_size, max_num_seqs, release):
    requests = (shared_prefix_workload(15, num_prefixes=2, prefix_len=9, suffix_len=(1, 6),
                                       output_len=(1, 8), seed=seed)
                + multi_turn_workload(3, 2, system_len=5, user_len=(1, 4), output_len=(1, 5), seed=seed))
    requests = [r for r in requests if r.num_tokens <= num_blocks * block_size]
    bm = make_block_manager(num_blocks, block_size, release=release)
    sim = Simulator(requests, bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=32)
    result = sim.run()
    assert all(sim.finished)
    for r, seq in zip(requests, sim.seqs):
        assert seq.token_ids == list(r.prompt_token_ids + r.output_token_ids)
        assert not seq.block_table
    for i, r in enumerate(requests):  # a chat's next turn waits for the previous one to finish
        if r.parent is not None:
            assert sim.admitted_at[i] > sim.finished_at[r.parent]
    assert sorted(bm.free_block_ids) == list(range(num_blocks)) and not bm.used_block_ids
    assert 0 < result.max_kv_cache_usage <= 1
    # Preempted requests are admitted (and queried) again.
    assert result.prefix_cache_queries >= sum(len(r.prompt_token_ids) for r in requests)
    assert sim.step() == "idle"


def test_release_order_does_not_matter_when_nothing_is_evicted():
    requests = shared_prefix_workload(200, num_prefixes=5, prefix_len=64, seed=3)
    big = sum(r.num_tokens for r in requests)
    a = simulate(requests, big, 16, release="reversed")
    b = simulate(requests, big, 16, release="forward")
    assert a.prefix_cache_hits == b.prefix_cache_hits > 0


def test_linked_free_queue_gives_the_same_simulation():
    requests = shared_prefix_workload(300, num_prefixes=6, prefix_len=64, seed=4)
    assert simulate(requests, 60, 16, free_queue="deque") == simulate(requests, 60, 16, free_queue="linked")


def test_no_hits_with_prefix_caching_disabled():
    requests = shared_prefix_workload(100, num_prefixes=2, prefix_len=64, seed=0)
    result = simulate(requests, 200, 16, enable_prefix_caching=False)
    assert result.prefix_cache_hits == 0 and result.prefix_cache_queries > 0
    assert simulate(requests, 200, 16).prefix_cache_hits > 0


def test_simulator_rejects_requests_that_never_fit():
    with pytest.raises(ValueError, match="needs up to 3 blocks"):
        Simulator([Request((1,) * 8, (2,) * 3)], BlockManager(2, 4))
    with pytest.raises(ValueError, match="parent"):
        Simulator([Request((1,), (2,), parent=0)], BlockManager(2, 4))


# ------------------------------------------------------------------ forward release

def test_forward_release_puts_the_prefix_at_the_head_side():
    fwd, rev = ForwardReleaseBlockManager(6, 2), BlockManager(6, 2)
    for bm in (fwd, rev):
        seq = Sequence([1, 2, 3, 4, 5, 6, 7], block_size=2)
        bm.allocate(seq, bm.can_allocate(seq))
        assert seq.block_table == [0, 1, 2, 3]
        bm.deallocate(seq)
    assert list(fwd.free_block_ids) == [4, 5, 0, 1, 2, 3]
    assert list(rev.free_block_ids) == [4, 5, 3, 2, 1, 0]


def test_forward_release_misuse_raises_and_changes_nothing():
    bm = ForwardReleaseBlockManager(4, 2)
    seq = Sequence([1, 2, 3], block_size=2)
    with pytest.raises(ValueError, match="holds no blocks"):
        bm.deallocate(seq)
    assert list(bm.free_block_ids) == [0, 1, 2, 3] and seq.block_table == []
    with pytest.raises(ValueError, match="release"):
        make_block_manager(4, 2, release="sideways")


# ------------------------------------------------------------------ against the real Scheduler

@pytest.mark.parametrize("num_blocks,max_num_seqs", [(40, 8), (60, 2), (400, 16)])
def test_simulator_matches_the_engine_scheduler(num_blocks, max_num_seqs):
    """The experiments' simulator and chapter 06's Scheduler make the same decisions: same
    prefix-cache queries and hits, same preemptions, same computed tokens, same outputs."""
    from course_pkg.scheduler import Scheduler
    from course_pkg.workloads import serve_with_scheduler

    requests = (shared_prefix_workload(150, num_prefixes=6, prefix_len=100, output_len=(4, 40), seed=7)
                + multi_turn_workload(6, 3, system_len=30, user_len=(4, 20), output_len=(4, 30), seed=7))
    budget = 10**6  # no chunking: the simulator never chunks a prompt
    sim = Simulator(requests, BlockManager(num_blocks, 16), max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=budget)
    result = sim.run()
    scheduler = Scheduler(num_blocks, 16, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    seqs = serve_with_scheduler(requests, scheduler)
    stats = scheduler.block_manager.prefix_cache_stats
    assert (stats.queries, stats.hits) == (result.prefix_cache_queries, result.prefix_cache_hits)
    assert scheduler.stats.num_preemptions == result.num_preemptions
    assert scheduler.stats.prefill_kv_computed_tokens == result.num_computed_tokens
    assert [s.token_ids for s in seqs] == [s.token_ids for s in sim.seqs]
    assert (max_num_seqs, num_blocks) != (8, 40) or result.num_preemptions > 0
