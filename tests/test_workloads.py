"""Workload generators, and serving them with the real Scheduler and a fake model.

``WorkloadRun`` is checked against independent references: with a pool too large to evict
anything and one request at a time, the prefix-cache hits of each request are exactly the
leading full blocks of its prompt that earlier requests computed -- which a set of token
prefixes computes without any BlockManager -- and the number of steps follows from the
prompt lengths and the token budget (chunked prefill) by arithmetic alone.
"""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_pkg import BlockManager, SamplingParams, Sequence
from course_pkg.scheduler import Scheduler
from course_pkg.foils import ForwardReleaseBlockManager, UnguardedBlockManager, make_block_manager
from course_pkg.workloads import (Request, WorkloadRun, multi_turn_workload, random_workload,
                                  shared_prefix_workload, simulate)


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


# ------------------------------------------------------------------ serving with the real Scheduler

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


@pytest.mark.parametrize("block_size,budget", [(1, 4096), (3, 7), (16, 4096), (16, 20)])
def test_hits_match_an_independent_reference_without_eviction(block_size, budget):
    requests = (shared_prefix_workload(40, num_prefixes=3, prefix_len=37, suffix_len=(1, 20),
                                       output_len=(1, 9), seed=block_size)
                + multi_turn_workload(4, 3, system_len=20, user_len=(1, 7), output_len=(1, 12), seed=5))
    total = sum(r.num_tokens for r in requests)
    result = simulate(requests, num_blocks=total, block_size=block_size, max_num_seqs=1,
                      max_num_batched_tokens=budget)
    expected = _reference_hits(requests, block_size)
    assert result.prefix_cache_hits == sum(expected)
    assert result.prefix_cache_queries == sum(len(r.prompt_token_ids) for r in requests)
    assert result.num_preemptions == 0
    assert result.num_computed_tokens == result.prefix_cache_queries - result.prefix_cache_hits
    # One request at a time: its prompt's uncached tokens in chunks of at most `budget`
    # (the last chunk samples the first output token), then one decode step per further token.
    steps = sum(-(-(len(r.prompt_token_ids) - hit) // budget) + len(r.output_token_ids) - 1
                for r, hit in zip(requests, expected))
    assert result.num_steps == steps


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(12, 60), block_size=st.integers(1, 4),
       max_num_seqs=st.integers(1, 6), budget=st.integers(1, 40), release=st.sampled_from(["reversed", "forward"]))
def test_every_request_finishes_with_its_tokens_and_the_pool_is_whole_again(
        seed, num_blocks, block_size, max_num_seqs, budget, release):
    requests = (shared_prefix_workload(15, num_prefixes=2, prefix_len=9, suffix_len=(1, 6),
                                       output_len=(1, 8), seed=seed)
                + multi_turn_workload(3, 2, system_len=5, user_len=(1, 4), output_len=(1, 5), seed=seed))
    requests = [r for r in requests if r.num_tokens - 1 <= num_blocks * block_size]
    requests = [dataclasses.replace(r, parent=None) for r in requests]  # filtering broke the indices
    bm = make_block_manager(num_blocks, block_size, release=release)
    scheduler = Scheduler(num_blocks, block_size, block_manager=bm, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget)
    run = WorkloadRun(requests, scheduler)
    batches = []
    real_schedule = scheduler.schedule

    def recording_schedule():
        out = real_schedule()
        batches.append(sum(s.num_scheduled_tokens for s in out.seqs))
        assert batches[-1] == out.total_num_scheduled_tokens
        return out

    scheduler.schedule = recording_schedule
    while not run.done:
        run.step()
        # `holding` knows where blocks can be; every sequence's own table says where they are.
        assert {s.seq_id for s in run.holding} == {s.seq_id for s in run.seqs if s.block_table}
    result = run.result()
    assert all(run.finished)
    for r, seq in zip(requests, run.seqs):
        assert seq.token_ids == list(r.prompt_token_ids + r.output_token_ids)
        assert not seq.block_table
    assert sorted(bm.free_block_ids) == list(range(num_blocks)) and not bm.used_block_ids
    assert 0 < result.max_kv_cache_usage <= 1
    assert max(batches) <= budget  # the token budget holds: long prompts were chunked
    # Each request is queried once at its first admission; readmissions after a preemption
    # are counted apart (vLLM v1's preempted_* fields) and stay out of the hit rate.
    assert result.prefix_cache_queries == sum(len(r.prompt_token_ids) for r in requests)
    assert bm.prefix_cache_stats.requests == len(requests)
    assert bm.prefix_cache_stats.preempted_requests == result.num_preemptions
    assert run.step() == "idle"


def test_a_chat_turn_is_admitted_only_after_its_previous_turn_finished():
    requests = multi_turn_workload(4, 3, system_len=10, user_len=(2, 6), output_len=(2, 6), seed=1)
    run = WorkloadRun(requests, Scheduler(200, 4, max_num_seqs=8, max_num_batched_tokens=64))
    run.run()
    for i, r in enumerate(requests):
        if r.parent is not None:
            assert run.admitted_at[i] > run.finished_at[r.parent]
    assert run.admitted_at[1] == 0  # independent chats share the first step


def test_release_order_does_not_matter_when_nothing_is_evicted():
    requests = shared_prefix_workload(200, num_prefixes=5, prefix_len=64, seed=3)
    big = sum(r.num_tokens for r in requests)
    a = simulate(requests, big, 16, release="reversed")
    b = simulate(requests, big, 16, release="forward")
    assert a.prefix_cache_hits == b.prefix_cache_hits > 0


def test_release_order_matters_under_pressure():
    # 2 blocks of 2 tokens hold one 3-token request. The forward foil puts the prefix block
    # at the head of the free queue, so the next request overwrites it; reversed keeps it.
    requests = [Request((1, 2, 3), (4,)), Request((9, 9, 9), (4,)), Request((1, 2, 5), (4,))]
    hits = {release: simulate(requests, 3, 2, release=release, max_num_seqs=1).prefix_cache_hits
            for release in ("reversed", "forward")}
    assert hits == {"reversed": 2, "forward": 0}


def test_linked_free_queue_gives_the_same_simulation():
    requests = shared_prefix_workload(300, num_prefixes=6, prefix_len=64, seed=4)
    assert simulate(requests, 60, 16, free_queue="deque") == simulate(requests, 60, 16, free_queue="linked")


def test_no_hits_with_prefix_caching_disabled():
    requests = shared_prefix_workload(100, num_prefixes=2, prefix_len=64, seed=0)
    result = simulate(requests, 200, 16, enable_prefix_caching=False)
    assert result.prefix_cache_hits == 0 and result.prefix_cache_queries > 0
    assert simulate(requests, 200, 16).prefix_cache_hits > 0


def test_workload_run_rejects_bad_requests_before_running_anything():
    scheduler = Scheduler(2, 4)
    with pytest.raises(ValueError, match="request 1: .*can never fit"):
        WorkloadRun([Request((1,), (2,)), Request((1,) * 8, (2,) * 3)], scheduler)
    with pytest.raises(ValueError, match="parent"):
        WorkloadRun([Request((1,), (2,), parent=0)], scheduler)
    assert scheduler.is_finished() and scheduler.block_manager.num_free_blocks == 2
    scheduler.add(Sequence([1, 2], SamplingParams(max_tokens=1), block_size=4))
    with pytest.raises(ValueError, match="fresh"):
        WorkloadRun([Request((1,), (2,))], scheduler)


def test_scheduler_runs_over_a_given_block_manager():
    for cls in (ForwardReleaseBlockManager, UnguardedBlockManager):
        bm = cls(8, 4)
        assert Scheduler(8, 4, block_manager=bm).block_manager is bm
    with pytest.raises(ValueError, match="block_manager has 8 blocks of 4 tokens"):
        Scheduler(9, 4, block_manager=BlockManager(8, 4))
    with pytest.raises(ValueError, match="block_manager has 8 blocks of 4 tokens"):
        Scheduler(8, 2, block_manager=BlockManager(8, 4))


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


def test_a_simulation_without_the_journal_decides_exactly_what_a_journaled_one_does():
    """``simulate`` runs its Scheduler with ``transactional=False`` (nothing enrolled: the journal
    only cost time there); the steps, hits and preemptions are those of a journaled Scheduler."""
    from course_pkg.undo import journal_of
    from course_pkg.workloads.harness import make_block_manager, simulate
    from course_pkg.workloads.requests import shared_prefix_workload

    requests = shared_prefix_workload(60, num_prefixes=3, prefix_len=40, suffix_len=(4, 12), output_len=(4, 24),
                                      seed=5)
    plain = Scheduler(8, 4, transactional=False)
    assert journal_of(plain) is None and journal_of(plain.block_manager) is None
    bm = make_block_manager(48, 4, release="reversed", free_queue="deque", enable_prefix_caching=True)
    journaled = WorkloadRun(requests, Scheduler(48, 4, block_manager=bm, max_num_seqs=32,
                                                max_num_batched_tokens=4096)).run()
    assert journal_of(bm) is not None
    assert simulate(requests, 48, 4) == journaled
