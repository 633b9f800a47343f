"""Chapter 11: the replay in time (``workloads/timed_replay.py``).

References independent of the code under test: a four-request trace worked out by hand (times,
waits, hits, the average number running); the untimed ``replay`` -- itself checked in lockstep
with the BlockManager and Nano-vLLM -- which the timed one must equal when no two requests
overlap; the infinite cache's hits computed directly from the blocks every earlier request
held; and invariants for any trace: the pool is never over-full, requests are admitted in
arrival order and never before they arrive, no policy hits more than the infinite cache.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_pkg.workloads.cache_policies import POLICIES, LruPolicy
from course_pkg.workloads.replay import replay
from course_pkg.workloads.timed_replay import replay_timed, request_blocks
from course_pkg.workloads.traces import TraceRequest

ALL = list(POLICIES)


def test_a_hand_worked_trace_gives_the_times_waits_and_hits_worked_out_by_hand():
    # Speeds: prefill 10,000 tokens/s, decode 20 tokens/s (the defaults). Pool 4.
    trace = [
        TraceRequest(0.0, 1024, 20, (1, 2)),      # A: holds 1, 2 and a new block for its answer;
                                                  #    runs 1024/10000 + 20/20 = 1.1024 s
        TraceRequest(500.0, 1536, 0, (1, 2, 3)),  # B: A holds 1 and 2: two hits, one new block (4 in use);
                                                  #    runs 512/10000 = 0.0512 s
        TraceRequest(600.0, 1024, 0, (4, 5)),     # C: A holds 3 blocks, only 3 (B's) is free: waits for A
        TraceRequest(5000.0, 1024, 0, (1, 2)),    # D: is 1 still cached? C took two of 1, 2, 3, A's answer
    ]
    # C's two blocks: reversed release freed A's answer, 2, 1 after B's 3, so 3 and the answer go;
    # forward release freed 1 first, and the exact LRU's oldest read is A's answer, then 1 (B read
    # 1 before 3); the tree gives up leaves only: A's answer, then 3.
    d_hits = {"vllm": 1, "forward": 0, "lru": 0, "radix": 1, "belady": 1, "infinite": 1}
    for policy in ALL:
        r = replay_timed(trace, policy, 4)
        assert r.hits == (0, 2, 0, d_hits[policy]), policy
        assert r.full_blocks == 1 + 2 + 1 + 1, policy
        assert r.hits_on_held == 2, policy                 # B's two hits: A held them
        assert r.admission_order == (0, 1, 2, 3)
        assert r.max_running == 2
        if policy == "infinite":
            assert r.max_wait_s == 0                        # no pool, so C does not wait
            continue
        assert r.max_wait_s == pytest.approx(1.1024 - 0.6)
        assert r.mean_wait_s == pytest.approx((1.1024 - 0.6) / 4)
        d = (1024 - 512 * d_hits[policy]) / 10_000          # D's prefill, shorter by its hit
        busy = 1.1024 + 0.0512 + 0.1024 + d                 # each request's duration
        assert r.mean_running == pytest.approx(busy / (5.0 + d))


def test_a_request_holds_its_answer_blocks_and_a_partial_last_block_is_its_own():
    trace = [TraceRequest(0.0, 1024, 600, (7, 8)),        # on a boundary: 7, 8 shared, + 2 answer blocks
             TraceRequest(1.0, 1000, 24, (7, 9))]         # 9 is partial: the answer fills it, so it is new
    (p0, h0), (p1, h1) = request_blocks(trace)
    assert p0 == (7, 8) and h0[:2] == (7, 8) and len(h0) == 4
    assert p1 == (7, 9) and h1[0] == 7 and len(h1) == 2 and h1[1] not in (7, 8, 9, *h0)
    assert len(set(h0[2:]) | {h1[1]}) == 3                  # every answer block is new


def test_a_request_larger_than_the_pool_is_skipped_with_its_answer_counted():
    trace = [TraceRequest(0.0, 1024, 1024, (1, 2)), TraceRequest(1.0, 512, 0, (3,))]
    r = replay_timed(trace, "vllm", 3)                      # the first needs 4 blocks
    assert r.skipped == 1 and r.hits == (None, 0) and r.num_requests == 1


def test_max_num_seqs_bounds_the_requests_running_at_once():
    trace = [TraceRequest(float(t), 512, 40, (t + 1,)) for t in range(10)]   # each runs ~2 s
    free = replay_timed(trace, "radix", 100)
    bounded = replay_timed(trace, "radix", 100, max_num_seqs=2)
    assert free.max_running > 2 and free.max_wait_s == 0
    assert bounded.max_running == 2 and bounded.max_wait_s > 0


@pytest.mark.parametrize("bad", [dict(speedup=0), dict(speedup=float("nan")), dict(decode_speed=-1.0),
                                 dict(prefill_speed=float("inf")), dict(speedup=True), dict(max_num_seqs=0)])
def test_bad_parameters_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        replay_timed([TraceRequest(0.0, 512, 1, (1,))], "vllm", 4, **bad)


def test_a_request_without_prompt_blocks_is_refused():
    with pytest.raises(ValueError, match="input_length 0"):
        replay_timed([TraceRequest(0.0, 0, 1, ())], "vllm", 4)


# ---------------------------------------------------------------- properties

paths = st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=5), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(paths=paths, pool=st.integers(5, 12), policy=st.sampled_from(ALL))
def test_with_no_two_requests_overlapping_it_equals_the_untimed_replay_one_at_a_time(paths, pool, policy):
    # Whole blocks and no answer: a request holds exactly its prompt's blocks, as in ``replay``;
    # a minute apart, each finishes before the next arrives.
    trace = [TraceRequest(60_000.0 * i, 512 * len(p), 0, tuple(p)) for i, p in enumerate(paths)]
    timed = replay_timed(trace, policy, pool)
    untimed = replay(trace, policy, pool, concurrency=1)
    assert timed.hits == untimed.hits
    assert timed.max_running == 1 and timed.max_wait_s == 0 and timed.hits_on_held == 0


class PoolWatch(LruPolicy):
    """The exact LRU, checking after every admission that the running requests' distinct blocks fit."""

    def admit(self, block_ids):
        got = super().admit(block_ids)
        assert sum(1 for n in self.ref_count.values() if n > 0) <= self.num_blocks
        return got


requests = st.lists(st.tuples(st.lists(st.integers(0, 6), min_size=1, max_size=4), st.integers(1, 511),
                              st.integers(0, 1500), st.integers(0, 3000)), min_size=1, max_size=14)


@settings(max_examples=60, deadline=None)
@given(requests=requests, pool=st.integers(4, 10), speedup=st.sampled_from([0.5, 1.0, 4.0]))
def test_for_any_trace_the_invariants_hold(requests, pool, speedup):
    t, trace = 0.0, []
    for ids, last_tokens, output, gap in requests:        # partial last blocks, answers, overlaps
        t += gap
        trace.append(TraceRequest(t, 512 * (len(ids) - 1) + last_tokens, output, tuple(ids)))
    blocks = request_blocks(trace)
    fits = [i for i, (_, held) in enumerate(blocks) if len(held) <= pool]
    # The infinite cache, directly: a leading run of the candidates in what earlier requests held.
    seen, expected = set(), {}
    for i in fits:
        prompt, held = blocks[i]
        run = 0
        while run < len(prompt) - 1 and prompt[run] in seen:
            run += 1
        expected[i] = run
        seen.update(held)
    infinite = replay_timed(trace, "infinite", pool, speedup=speedup)
    assert {i: infinite.hits[i] for i in fits} == expected
    for policy in [*ALL, PoolWatch]:
        r = replay_timed(trace, policy, pool, speedup=speedup)
        assert list(r.admission_order) == fits              # first come, first served
        assert r.mean_wait_s >= 0 and r.max_running <= len(fits)
        for i in fits:
            assert 0 <= r.hits[i] <= expected[i]
        assert r.hits_on_held <= r.hit_blocks
