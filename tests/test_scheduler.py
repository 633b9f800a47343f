"""Scheduler tests, without torch: a fake model that reads its "KV cache" through the block tables.

The fake model stores each computed token id (and its position) in a flat array of slots,
exactly where the real ModelRunner would write its K/V, and predicts the next token from the
context it reads back through the block table. A false prefix hit, a block handed out twice,
a chunk computed at the wrong positions or a preempted sequence resumed wrongly all change
what it reads, so its outputs differ from the reference generation computed without any cache.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_pkg import SamplingParams, Sequence, SequenceStatus
from course_pkg.scheduler import Scheduler
from tests.helpers import state, results

VOCAB = 50
EOS = 0


def next_token(context: list[int]) -> int:
    """A deterministic 'language model': depends on every token and its position."""
    h = 17
    for pos, t in enumerate(context):
        h = (h * 1_000_003 + (pos + 1) * (t + 7)) % 2_147_483_647
    return h % VOCAB


def reference(prompt: list[int], max_tokens: int, ignore_eos: bool, max_model_len: int | None = None) -> list[int]:
    tokens = list(prompt)
    out = []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if (not ignore_eos and t == EOS) or len(out) >= max_tokens:
            return out
        if max_model_len is not None and len(tokens) >= max_model_len:
            return out


class FakeRunner:
    """Writes (position, token) into slots and reads the context back through block tables."""

    def __init__(self, sched: Scheduler):
        self.bs = sched.block_size
        self.slots: list[tuple[int, int] | None] = [None] * (sched.block_manager.num_blocks * self.bs)
        self.computed_tokens = 0

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.bs] * self.bs + pos % self.bs

    def run(self, seqs: list[Sequence]) -> list[int | None]:
        out = []
        for seq in seqs:
            start, n = seq.num_cached_tokens, seq.num_scheduled_tokens
            assert n >= 1 and start + n <= seq.num_tokens
            for pos in range(start, start + n):
                self.slots[self.slot(seq, pos)] = (pos, seq.token_ids[pos])
            self.computed_tokens += n
            if start + n < seq.num_tokens:
                out.append(None)  # a chunk of the prompt: nothing to sample yet
                continue
            context = []
            for pos in range(seq.num_tokens):
                entry = self.slots[self.slot(seq, pos)]
                assert entry is not None and entry[0] == pos, f"slot for position {pos} holds {entry}"
                context.append(entry[1])
            out.append(next_token(context))
        return out


def check_pool(bm, live: list[Sequence]) -> None:
    """The BlockManager's invariants, for live sequences whose tables may lag by one block."""
    assert sorted(list(bm.free_block_ids) + list(bm.used_block_ids)) == list(range(bm.num_blocks))
    refs = [0] * bm.num_blocks
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table)
        for b in s.block_table:
            refs[b] += 1
    assert refs == [b.ref_count for b in bm.blocks]
    for h, bid in bm.hash_to_block_id.items():
        assert bm.blocks[bid].hash == h


def run_to_end(sched: Scheduler, runner: FakeRunner | None = None, check=True,
               max_steps=10_000) -> tuple[dict[int, list[int]], list]:
    """Drive the scheduler with the fake model; return outputs by seq_id and a step log."""
    runner = runner or FakeRunner(sched)
    outputs: dict[int, list[int]] = {}
    log = []
    for _ in range(max_steps):
        if sched.is_finished():
            return outputs, log
        out = sched.schedule()
        seqs, is_prefill = list(out.seqs), out.is_prefill
        if check:
            live = [s for s in list(sched.waiting) + list(sched.running) if s.block_table]
            check_pool(sched.block_manager, live)
            # A running sequence left out of a full decode batch may still lack its newest block.
            for s in live:
                assert s.num_blocks - len(s.block_table) in ((0,) if s in seqs else (0, 1))
            assert len(sched.running) <= sched.max_num_seqs
            assert sum(s.num_scheduled_tokens for s in seqs) <= sched.max_num_batched_tokens
            assert all(s.status == SequenceStatus.RUNNING for s in sched.running)
            if not is_prefill:
                assert all(s.num_scheduled_tokens == 1 for s in seqs)
                assert seqs == list(sched.running)[:len(seqs)]
        log.append((is_prefill, [(s.seq_id, s.num_cached_tokens, s.num_scheduled_tokens) for s in seqs]))
        for seq in sched.update_from_output(out, results(out, runner.run(seqs))):
            outputs[seq.seq_id] = seq.completion_token_ids
            assert seq.block_table == []
    raise AssertionError("the scheduler did not finish")


def make_seq(prompt, max_tokens=5, bs=4, ignore_eos=True):
    return Sequence(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos),
                    block_size=bs)


# ---------------------------------------------------------------- hand-checked cases

def test_single_request_prefill_then_decode():
    sched = Scheduler(8, 4, max_num_seqs=4, max_num_batched_tokens=64)
    seq = make_seq(list(range(1, 7)), max_tokens=3)
    sched.add(seq)
    outputs, log = run_to_end(sched)
    assert outputs[seq.seq_id] == reference(list(range(1, 7)), 3, True)
    # one prefill step of 6 tokens, then 2 decode steps (the 3rd token is sampled, never fed back)
    assert log == [(True, [(seq.seq_id, 0, 6)]), (False, [(seq.seq_id, 6, 1)]), (False, [(seq.seq_id, 7, 1)])]
    assert sched.stats.prompt_tokens == 6 and sched.stats.generation_tokens == 3
    assert sched.stats.num_prefill_steps == 1 and sched.stats.num_decode_steps == 2


def test_continuous_batching_admits_new_requests_while_others_decode():
    sched = Scheduler(16, 4, max_num_seqs=8, max_num_batched_tokens=64)
    a = make_seq([1, 2, 3], max_tokens=4)
    sched.add(a)
    runner = FakeRunner(sched)
    out = sched.schedule()
    seqs, is_prefill = list(out.seqs), out.is_prefill
    sched.update_from_output(out, results(out, runner.run(seqs)))
    out = sched.schedule()
    seqs, is_prefill = list(out.seqs), out.is_prefill
    assert not is_prefill and seqs == [a]
    sched.update_from_output(out, results(out, runner.run(seqs)))
    b = make_seq([5, 6, 7, 8, 9], max_tokens=2)
    sched.add(b)  # arrives while a is decoding: the next step prefills it, then both decode
    out = sched.schedule()
    seqs, is_prefill = list(out.seqs), out.is_prefill
    assert is_prefill and seqs == [b]
    sched.update_from_output(out, results(out, runner.run(seqs)))
    out = sched.schedule()
    seqs, is_prefill = list(out.seqs), out.is_prefill
    assert not is_prefill and seqs == [a, b]


def test_whole_prompt_cached_still_computes_the_last_block():
    """A prompt seen before is cached except the block holding its last token."""
    for prompt_len, expected_hit in ((8, 4), (9, 8), (4, 0), (1, 0)):
        sched = Scheduler(16, 4, max_num_batched_tokens=64)
        prompt = list(range(10, 10 + prompt_len))
        first = make_seq(prompt, max_tokens=2)
        sched.add(first)
        run_to_end(sched)
        again = make_seq(prompt, max_tokens=2)
        sched.add(again)
        out = sched.schedule()
        seqs, is_prefill = list(out.seqs), out.is_prefill
        assert is_prefill and seqs == [again]
        assert again.num_cached_tokens == expected_hit
        assert again.num_scheduled_tokens == prompt_len - expected_hit >= 1
    # The cached blocks hold the right K/V: one fake runner serves both requests.
    sched = Scheduler(16, 4, max_num_batched_tokens=64)
    prompt = list(range(10, 18))
    s1, s2 = make_seq(prompt, max_tokens=3), make_seq(prompt, max_tokens=3)
    sched.add(s1)
    runner = FakeRunner(sched)
    out, _ = run_to_end(sched, runner)
    sched.add(s2)
    out.update(run_to_end(sched, runner)[0])
    assert out[s1.seq_id] == out[s2.seq_id] == reference(prompt, 3, True)
    stats = sched.block_manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 16, 4)
    assert sched.stats.prefill_kv_computed_tokens == 8 + 4


def test_two_sequences_sharing_a_prefix_admitted_in_one_step():
    """Neither may hit the other's blocks: their K/V are computed in the same step."""
    sched = Scheduler(16, 4, max_num_batched_tokens=64)
    prefix = [3, 1, 4, 1, 5, 9, 2, 6]
    a, b = make_seq(prefix + [11, 12], 3), make_seq(prefix + [21], 3)
    sched.add(a)
    sched.add(b)
    runner = FakeRunner(sched)
    out = sched.schedule()
    seqs, is_prefill = list(out.seqs), out.is_prefill
    assert is_prefill and seqs == [a, b]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0  # no hit on uncomputed blocks
    assert set(a.block_table).isdisjoint(b.block_table)
    sched.update_from_output(out, results(out, runner.run(seqs)))
    # both registered their two full prefix blocks; a third request now hits 8 tokens
    c = make_seq(prefix + [31, 32, 33], 3)
    sched.add(c)
    out = sched.schedule()
    seqs, _ = list(out.seqs), out.is_prefill
    assert seqs == [c] and c.num_cached_tokens == 8
    assert c.block_table[:2] == b.block_table[:2]  # the index points at the latest registration
    sched.update_from_output(out, results(out, runner.run(seqs)))
    outputs, _ = run_to_end(sched, runner)
    for s in (a, b, c):
        assert outputs[s.seq_id] == reference(s.prompt_token_ids, 3, True)


def test_chunked_prefill_splits_a_long_prompt_and_keeps_it_first_in_line():
    sched = Scheduler(16, 4, max_num_seqs=4, max_num_batched_tokens=5)
    long, short = make_seq(list(range(1, 13)), 2), make_seq([40, 41], 2)
    sched.add(long)
    sched.add(short)
    outputs, log = run_to_end(sched)
    # 12 prompt tokens in chunks of 5, 5 and 2; the short prompt fills the rest of the 3rd step
    assert log[:3] == [
        (True, [(long.seq_id, 0, 5)]),
        (True, [(long.seq_id, 5, 5)]),
        (True, [(long.seq_id, 10, 2), (short.seq_id, 0, 2)]),
    ]
    assert outputs[long.seq_id] == reference(list(range(1, 13)), 2, True)
    assert outputs[short.seq_id] == reference([40, 41], 2, True)


def test_chunk_in_progress_holds_its_blocks_in_waiting():
    sched = Scheduler(16, 4, max_num_batched_tokens=4)
    seq = make_seq(list(range(1, 11)), 2)
    sched.add(seq)
    out = sched.schedule()
    seqs, _ = list(out.seqs), out.is_prefill
    assert seqs == [seq] and seq.num_scheduled_tokens == 4
    # admitted (RUNNING: it holds blocks), but its prompt continues from waiting
    assert list(sched.waiting) == [seq] and seq.status == SequenceStatus.RUNNING
    assert len(seq.block_table) == 3  # the whole prompt's blocks, allocated at admission
    assert sched.update_from_output(out, results(out, [None])) == []
    assert seq.num_cached_tokens == 4 and len(seq.block_hashes) == 1  # the first block is registered


def test_preemption_by_recompute_when_decode_cannot_get_a_block():
    # 4 blocks of 2 tokens. a and b each take 2 blocks for their 3-4 token prompts.
    sched = Scheduler(4, 2, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make_seq([1, 2, 3, 4], 3, bs=2), make_seq([5, 6, 7], 3, bs=2)
    sched.add(a)
    sched.add(b)
    runner = FakeRunner(sched)
    out = sched.schedule()
    seqs, is_prefill = list(out.seqs), out.is_prefill
    assert is_prefill and seqs == [a, b] and sched.block_manager.num_free_blocks == 0
    sched.update_from_output(out, results(out, runner.run(seqs)))
    # a's 5th token starts a third block; none is free: b, admitted last, is preempted
    out = sched.schedule()
    seqs, is_prefill = list(out.seqs), out.is_prefill
    assert not is_prefill and seqs == [a]
    assert sched.stats.num_preemptions == 1
    assert list(sched.waiting) == [b] and b.block_table == [] and b.num_cached_tokens == 0
    assert b.status == SequenceStatus.PREEMPTED and b.num_completion_tokens == 1  # kept its token
    sched.update_from_output(out, results(out, runner.run(seqs)))
    outputs, _ = run_to_end(sched, runner)
    assert outputs[a.seq_id] == reference([1, 2, 3, 4], 3, True)
    assert outputs[b.seq_id] == reference([5, 6, 7], 3, True)


def test_admission_is_first_come_first_served_a_later_request_never_overtakes_the_head():
    # 6 blocks of 2 tokens. a runs and grows to 4 blocks; head needs 5 for its prompt, so it
    # must wait until a finishes. small needs 1 and would fit at once -- but it came later.
    sched = Scheduler(6, 2, max_num_batched_tokens=64)
    a = make_seq([1, 2, 3, 4], 5, bs=2)
    sched.add(a)
    runner = FakeRunner(sched)
    out = sched.schedule()
    seqs, _ = list(out.seqs), out.is_prefill
    sched.update_from_output(out, results(out, runner.run(seqs)))
    head, small = make_seq(list(range(10, 20)), 2, bs=2), make_seq([40], 2, bs=2)
    sched.add(head)
    sched.add(small)
    assert sched.block_manager.num_free_blocks >= 2        # room for small, not for head
    out = sched.schedule()
    seqs, is_prefill = list(out.seqs), out.is_prefill
    assert not is_prefill and seqs == [a]                  # a decodes; nobody is admitted
    assert list(sched.waiting) == [head, small] and small.block_table == []
    sched.update_from_output(out, results(out, runner.run(seqs)))
    outputs, log = run_to_end(sched, runner)
    def first_step(seq):       # the step that first scheduled it, counted after the check above
        return next(i for i, (_, batch) in enumerate(log) if seq.seq_id in {e[0] for e in batch})
    assert first_step(small) >= first_step(head)
    for seq in (a, head, small):
        assert outputs[seq.seq_id] == reference(seq.prompt_token_ids, seq.max_tokens, True)


def test_max_num_seqs_limits_the_running_batch():
    sched = Scheduler(64, 4, max_num_seqs=2, max_num_batched_tokens=64)
    seqs_in = [make_seq([i + 1, i + 2], 3) for i in range(5)]
    for s in seqs_in:
        sched.add(s)
    runner = FakeRunner(sched)
    out = sched.schedule()
    seqs, _ = list(out.seqs), out.is_prefill
    assert seqs == seqs_in[:2] and len(sched.waiting) == 3
    sched.update_from_output(out, results(out, runner.run(seqs)))
    outputs, log = run_to_end(sched, runner)
    assert max(len(batch) for _, batch in log) <= 2
    for s in seqs_in[2:]:
        assert outputs[s.seq_id] == reference(s.prompt_token_ids, 3, True)


def test_eos_and_max_model_len_finish_a_sequence():
    prompt = [7, 8, 9]
    ref = reference(prompt, 50, ignore_eos=True)
    stop = next(i for i in range(2, 50) if ref[i] not in ref[:i])  # first new token after two
    sched = Scheduler(64, 4, max_num_batched_tokens=64, eos_token_id=[ref[stop], VOCAB + 1])
    stop_at_eos = make_seq(prompt, 50, ignore_eos=False)
    keep_going = make_seq(prompt, 6, ignore_eos=True)
    sched.add(stop_at_eos)
    sched.add(keep_going)
    outputs, _ = run_to_end(sched)
    assert outputs[stop_at_eos.seq_id] == ref[:stop + 1]
    assert outputs[keep_going.seq_id] == ref[:6]
    sched = Scheduler(64, 4, max_num_batched_tokens=64, max_model_len=8)
    capped = make_seq(prompt, 50)
    sched.add(capped)
    outputs, _ = run_to_end(sched)
    assert outputs[capped.seq_id] == ref[:5] and capped.num_tokens == 8


# ---------------------------------------------------------------- clear errors, state unchanged

def test_request_that_can_never_fit_is_rejected_at_add():
    sched = Scheduler(4, 4, max_num_batched_tokens=64)
    ok = make_seq([1, 2, 3], max_tokens=14)  # stores 3 + 13 = 16 tokens: exactly 4 blocks
    sched.add(ok)
    too_long = make_seq(list(range(1, 18)), max_tokens=1)  # 17 tokens: 5 blocks
    too_many_tokens = make_seq([1, 2, 3], max_tokens=15)  # stores 17 tokens
    for seq in (too_long, too_many_tokens):
        before = (list(sched.waiting), sched.stats.prompt_tokens)
        with pytest.raises(ValueError, match="can never fit in the KV cache"):
            sched.add(seq)
        assert (list(sched.waiting), sched.stats.prompt_tokens) == before
    outputs, _ = run_to_end(sched)
    assert outputs[ok.seq_id] == reference([1, 2, 3], 14, True)


def test_bad_requests_and_settings_raise_clear_errors():
    sched = Scheduler(8, 4, max_num_batched_tokens=64, max_model_len=6)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(make_seq(list(range(1, 7))))
    with pytest.raises(ValueError, match="block_size"):
        sched.add(make_seq([1, 2], bs=2))
    seq = make_seq([1, 2])
    sched.add(seq)
    with pytest.raises(ValueError, match="already added"):
        sched.add(seq)
    assert list(sched.waiting) == [seq]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(8, 4, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(8, 4, max_num_seqs=0)
    with pytest.raises(ValueError, match="num_blocks"):
        Scheduler(0, 4)
    snapshot = state(sched.block_manager, [seq])
    out = sched.schedule()
    with pytest.raises(ValueError, match="results came back"):
        sched.update_from_output(out, [])
    assert state(sched.block_manager, [seq]) == snapshot and list(sched.waiting) == [seq]
    with pytest.raises(ValueError, match="n=3 completions"):
        Scheduler(64, 4, max_num_seqs=2).add(Sequence([1, 2], SamplingParams(n=3), block_size=4))
    with pytest.raises(ValueError, match="same_step_prefix_hits=True needs prefix caching"):
        Scheduler(8, 4, enable_prefix_caching=False, same_step_prefix_hits=True)
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        Scheduler(8, 4, num_cpu_blocks=4)


# ---------------------------------------------------------------- property: any workload, same outputs

workloads = st.fixed_dictionaries({
    "block_size": st.integers(1, 5),
    "num_blocks": st.integers(1, 24),
    "max_num_seqs": st.integers(1, 4),
    "extra_budget": st.integers(0, 12),
    "prefix_caching": st.booleans(),
    "requests": st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=10),
                  st.integers(1, 8), st.booleans()),
        min_size=1, max_size=6),
})
PREFIXES = [[], [5, 6, 7, 8, 9, 10], [5, 6, 7, 11]]


@settings(max_examples=150, deadline=None)
@given(workloads)
def test_any_workload_generates_the_reference_tokens(w):
    """Pool size, block size, budget, batch size and caching change the schedule, never the tokens."""
    bs = w["block_size"]
    sched = Scheduler(w["num_blocks"], bs, max_num_seqs=w["max_num_seqs"],
                      max_num_batched_tokens=1 + w["extra_budget"],
                      enable_prefix_caching=w["prefix_caching"], eos_token_id=EOS)
    expected = {}
    for prefix_id, suffix, max_tokens, ignore_eos in w["requests"]:
        seq = make_seq(PREFIXES[prefix_id] + suffix, max_tokens, bs=bs, ignore_eos=ignore_eos)
        try:
            sched.add(seq)
        except ValueError:
            assert sched.max_blocks_needed(seq) > w["num_blocks"]
            continue
        expected[seq.seq_id] = reference(seq.prompt_token_ids, max_tokens, ignore_eos)
    outputs, log = run_to_end(sched)
    assert outputs == expected
    assert sched.stats.generation_tokens == sum(len(v) for v in expected.values())
    stats = sched.block_manager.prefix_cache_stats
    assert 0 <= stats.hits <= stats.queries
    # one query per admission: every request once; a readmission after a preemption is
    # counted apart, as vLLM v1 does
    assert stats.requests == len(expected)
    assert stats.preempted_requests == sched.stats.num_preemptions
    assert 0 <= stats.preempted_hits <= stats.preempted_queries
    if not w["prefix_caching"]:
        assert stats.hits == 0
    assert sched.block_manager.num_free_blocks == w["num_blocks"]


def test_the_most_recently_admitted_sequence_is_preempted_first():
    # 6 blocks of 2 tokens; a, b, c hold 2 blocks each. a's next token needs a block: c goes.
    sched = Scheduler(6, 2, max_num_batched_tokens=64)
    a, b, c = (make_seq([1 + i, 2 + i, 3 + i, 4 + i], 4, bs=2) for i in range(3))
    for s in (a, b, c):
        sched.add(s)
    runner = FakeRunner(sched)
    out = sched.schedule()
    seqs, _ = list(out.seqs), out.is_prefill
    sched.update_from_output(out, results(out, runner.run(seqs)))
    out = sched.schedule()
    seqs, _ = list(out.seqs), out.is_prefill
    assert list(out.preempted) == [c] and list(sched.waiting) == [c]
    assert seqs == [a, b]        # c's two blocks went to a and b
    assert list(sched.running) == [a, b]


def _sched_state(sched: Scheduler, seqs: list[Sequence]) -> tuple:
    from dataclasses import astuple
    return (state(sched.block_manager, seqs), [s.status for s in seqs], [s.seq_id for s in sched.waiting],
            [s.seq_id for s in sched.running], [s.num_scheduled_tokens for s in seqs], astuple(sched.stats))


@pytest.mark.parametrize("bad", ["token_for_a_chunk", "no_token_after_prefill", "too_few", "not_a_list", "twice"])
def test_update_from_output_rejects_results_that_do_not_fit_the_step_and_undoes_it(bad):
    """Results that do not fit the step are refused, and the whole step is undone: the scheduler
    is as it was before ``schedule()`` (a recorded step cannot be recorded again)."""
    sched = Scheduler(8, 2, max_num_batched_tokens=8)
    long = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], SamplingParams(max_tokens=2), block_size=2)
    short = Sequence([1, 2, 3], SamplingParams(max_tokens=2), block_size=2)
    sched.add(short)
    sched.add(long)
    before = _sched_state(sched, [short, long])
    out = sched.schedule()              # short whole (3 tokens), long a 5-token chunk
    assert out.is_prefill and list(out.seqs) == [short, long] and out.num_scheduled_tokens == (3, 5)
    assert out.num_samples == (1, 0)
    if bad == "twice":
        sched.update_from_output(out, [[9], []])
        before = _sched_state(sched, [short, long])
        with pytest.raises(ValueError, match="not the open step"):
            sched.update_from_output(out, [[9], []])
    else:
        tokens = {"token_for_a_chunk": [[9], [9]], "no_token_after_prefill": [[], []],
                  "too_few": [[9]], "not_a_list": [9, None]}[bad]
        with pytest.raises(ValueError, match="token|results came back"):
            sched.update_from_output(out, tokens)
    assert _sched_state(sched, [short, long]) == before
