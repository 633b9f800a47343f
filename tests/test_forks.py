"""Forks and copy-on-write (chapter 08): the block manager, parallel sampling, beam search.

* ``BlockManager.fork`` and copy-on-write, by hand-worked examples and by random traces
  against a shadow model of what each physical block holds;
* parallel sampling: completion ``j`` of a request seeded ``s`` equals the one-completion
  request seeded ``s + j`` -- with and without preemption;
* beam search against Hugging Face ``generate(num_beams=k)``: the same hypotheses, in the
  same order, with the same scores.
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from course_pkg import LLM, BlockManager, NoFreeBlocksError, SamplingParams, Sequence
from course_pkg.foils import TokenCheckBlockManager
from course_pkg.models import build_random_checkpoint, default_model_path
from course_pkg.sampling_params import BeamSearchParams
from tests.helpers import admit, check_invariants, compute_all, state

MODEL = default_model_path()
CPU = dict(device="cpu", dtype=torch.float32, attention_backend="torch")


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """One torch thread for this module (see conftest)."""


def refs(bm):
    return [b.ref_count for b in bm.blocks]


def forked(bm, parent, index=1):
    child = parent.fork(index)
    bm.fork(parent, child)
    return child


# ---------------------------------------------------------------- fork and copy-on-write, by hand

def test_fork_shares_every_block_and_a_write_copies_the_partial_one():
    bm = BlockManager(8, 4)
    a = admit(bm, [1, 2, 3, 4, 5, 6])          # blocks 0 (full) and 1 (2 of 4 tokens)
    b = forked(bm, a)
    assert b.block_table == a.block_table == [0, 1] and refs(bm)[:3] == [2, 2, 0]
    check_invariants(bm, [a, b])
    a.append_token(7)
    assert bm.can_append(a)
    assert bm.may_append(a) == [(1, 2)]          # a writes into the shared partial block: copy
    assert a.block_table == [0, 2] and b.block_table == [0, 1] and refs(bm)[:3] == [2, 1, 1]
    b.append_token(8)
    assert bm.may_append(b) == []                # block 1 is b's alone now: written in place
    check_invariants(bm, [a, b])


def test_fork_of_a_fork_and_the_parent_released_first():
    bm = BlockManager(8, 2)
    a = admit(bm, [1, 2, 3])
    b = forked(bm, a)
    c = forked(bm, b, 2)
    assert c.block_table == [0, 1] and refs(bm)[:2] == [3, 3]
    bm.deallocate(a)
    assert refs(bm)[:2] == [2, 2] and bm.num_free_blocks == 6
    for seq in (b, c):
        seq.append_token(9)
    assert bm.may_append(b) == [(1, 2)] and bm.may_append(c) == []
    check_invariants(bm, [b, c])
    bm.deallocate(b)
    bm.deallocate(c)
    check_invariants(bm, [])


@pytest.mark.parametrize("block_size", [1, 7])
def test_copy_on_write_at_block_sizes_1_and_7(block_size):
    bm = BlockManager(12, block_size)
    a = admit(bm, list(range(1, 9)))             # 8 tokens
    b = forked(bm, a)
    a.append_token(20)
    copies = bm.may_append(a)
    if block_size == 1:                          # every block is full: the token starts a new one
        assert copies == [] and len(a.block_table) == 9 and a.block_table[:8] == b.block_table
    else:                                        # 8 = 7 + 1: the token lands in shared block 1
        assert copies == [(b.block_table[1], a.block_table[1])] and a.block_table[0] == b.block_table[0]
    check_invariants(bm, [a, b])


def test_copy_on_write_without_a_free_block_raises_and_changes_nothing():
    bm = BlockManager(2, 4)
    a = admit(bm, [1, 2, 3, 4, 5])               # both blocks
    b = forked(bm, a)
    a.append_token(6)
    assert not bm.can_append(a)
    before = state(bm, [a, b])
    with pytest.raises(NoFreeBlocksError):
        bm.may_append(a)
    assert state(bm, [a, b]) == before and refs(bm) == [2, 2]


def test_fork_of_a_sequence_with_prefix_cache_hits():
    bm = BlockManager(10, 2)
    first = admit(bm, [1, 2, 3, 4, 5])
    a = admit(bm, [1, 2, 3, 4, 6], compute=False)  # hits blocks 0 and 1
    assert a.block_table[:2] == first.block_table[:2] and a.num_cached_tokens == 4
    b = forked(bm, a)
    assert refs(bm)[first.block_table[0]] == 3 and b.block_hashes == a.block_hashes
    compute_all(bm, b)                           # b's full blocks are a's: nothing new registered
    check_invariants(bm, [first, a, b])


def test_fork_refuses_what_is_not_a_fresh_copy():
    bm = BlockManager(6, 2)
    a = admit(bm, [1, 2, 3])
    stranger = Sequence([1, 2, 4], block_size=2)
    with pytest.raises(ValueError, match="not a copy"):
        bm.fork(a, stranger)
    b = forked(bm, a)
    with pytest.raises(ValueError, match="already has blocks"):
        bm.fork(a, b)
    with pytest.raises(ValueError, match="holds no blocks"):
        bm.fork(Sequence([1], block_size=2), a.fork(3))
    check_invariants(bm, [a, b])


# ---------------------------------------------------------------- random traces with forks

class ForkMachine(RuleBasedStateMachine):
    """Admit, fork, append (with copy-on-write), compute, release -- checked against a shadow
    of the K/V each block holds: a hit or a shared block must hold this sequence's tokens."""

    @initialize(block_size=st.integers(1, 4), num_blocks=st.integers(2, 16))
    def setup(self, block_size, num_blocks):
        self.bm = BlockManager(num_blocks, block_size)
        self.bs = block_size
        self.live: list[Sequence] = []
        self.content: dict[int, list] = {}      # block id -> tokens whose K/V it holds, by offset

    def _written(self, seq):
        """Write the K/V of seq's computed tokens into the shadow."""
        for pos in range(seq.num_cached_tokens):
            slots = self.content.setdefault(seq.block_table[pos // self.bs], [None] * self.bs)
            slots[pos % self.bs] = tuple(seq.token_ids[:pos + 1])

    @rule(tokens=st.lists(st.integers(1, 3), min_size=1, max_size=7))
    def admit(self, tokens):
        seq = Sequence(tokens, block_size=self.bs)
        n = self.bm.can_allocate(seq)
        if n >= 0:
            self.bm.allocate(seq, n)
            for pos in range(seq.num_cached_tokens):     # hits hold this very prefix
                assert self.content[seq.block_table[pos // self.bs]][pos % self.bs] == tuple(tokens[:pos + 1])
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def fork(self, i):
        parent = self.live[i % len(self.live)]
        child = parent.fork(1)
        self.bm.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), token=st.integers(1, 3))
    def append_and_compute(self, i, token):
        """One decode step of one sequence: compute pending tokens, then append and place it."""
        seq = self.live[i % len(self.live)]
        seq.num_cached_tokens = seq.num_tokens
        self._written(seq)
        self.bm.hash_blocks(seq)
        seq.append_token(token)
        if not self.bm.can_append(seq):
            seq.token_ids.pop()
            seq.num_tokens -= 1
            return
        for src, dst in self.bm.may_append(seq):
            self.content[dst] = list(self.content.get(src, [None] * self.bs))
        # Every computed token of this sequence is where its block table says, intact.
        for pos in range(seq.num_cached_tokens):
            assert self.content[seq.block_table[pos // self.bs]][pos % self.bs] == tuple(seq.token_ids[:pos + 1])

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def release(self, i):
        self.bm.deallocate(self.live.pop(i % len(self.live)))

    @invariant()
    def consistent(self):
        check_invariants(self.bm, self.live)
        for seq in self.live:   # every computed token of every sequence is still intact
            for pos in range(seq.num_cached_tokens):
                slots = self.content.get(seq.block_table[pos // self.bs])
                assert slots is not None and slots[pos % self.bs] == tuple(seq.token_ids[:pos + 1])

    def teardown(self):
        for seq in self.live:
            self.bm.deallocate(seq)
        check_invariants(self.bm, [])


ForkMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestForkMachine = ForkMachine.TestCase


# ---------------------------------------------------------------- exact hits keep Nano-vLLM's choices

class LockstepMachine(RuleBasedStateMachine):
    """The same trace on the BlockManager and on Nano-vLLM's token-only check: with no hash
    collision (xxhash64, tiny traces) every block id, ref count and free-queue order agrees."""

    @initialize(block_size=st.integers(1, 3), num_blocks=st.integers(1, 12))
    def setup(self, block_size, num_blocks):
        self.pair = (BlockManager(num_blocks, block_size), TokenCheckBlockManager(num_blocks, block_size))
        self.bs = block_size
        self.live: list[tuple[Sequence, Sequence]] = []

    @rule(tokens=st.lists(st.integers(1, 2), min_size=1, max_size=7), compute=st.booleans())
    def admit(self, tokens, compute):
        seqs = tuple(Sequence(tokens, block_size=self.bs) for _ in self.pair)
        hits = [bm.can_allocate(s) for bm, s in zip(self.pair, seqs)]
        assert hits[0] == hits[1]
        if hits[0] >= 0:
            for bm, s in zip(self.pair, seqs):
                bm.allocate(s, hits[0])
                if compute:
                    compute_all(bm, s)
            self.live.append(seqs)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), token=st.integers(1, 2))
    def decode(self, i, token):
        pair = self.live[i % len(self.live)]
        for bm, s in zip(self.pair, pair):
            compute_all(bm, s)
            s.append_token(token)
        if all(bm.can_append(s) for bm, s in zip(self.pair, pair)):
            for bm, s in zip(self.pair, pair):
                bm.may_append(s)
        else:
            for s in pair:
                s.token_ids.pop()
                s.num_tokens -= 1

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def release(self, i):
        for bm, s in zip(self.pair, self.live.pop(i % len(self.live))):
            bm.deallocate(s)

    @invariant()
    def same(self):
        a, b = self.pair
        assert state(a, [s for s, _ in self.live]) == state(b, [s for _, s in self.live])


LockstepMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
TestLockstepWithNanoVllmCheck = LockstepMachine.TestCase


# ---------------------------------------------------------------- parallel sampling

PROMPT = [306, 273, 417, 337, 78, 355, 693, 311, 14]


def sampled(llm, seed, n=1, max_tokens=6):
    return llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=max_tokens,
                                                 ignore_eos=True), use_tqdm=False)[0]


PROMPT2 = [33, 429, 367, 268, 377, 438, 259]


def seeded(seed, n=1):
    return SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("pool", [64, 12], ids=["roomy", "preempting"])
def test_completion_j_equals_the_single_request_seeded_s_plus_j(pool):
    """Two requests of 4 completions each; in 12 blocks each fits alone (9 + 6 tokens: 2
    shared blocks + 4 x 2 of its own) but not both at once, so completions are preempted."""
    llm = LLM(MODEL, block_size=4, num_kvcache_blocks=pool, **CPU)
    outs = llm.generate([PROMPT, PROMPT2], [seeded(100, n=4), seeded(200, n=4)], use_tqdm=False)
    single = LLM(MODEL, block_size=4, num_kvcache_blocks=64, **CPU)
    for out, prompt, seed in zip(outs, [PROMPT, PROMPT2], [100, 200]):
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        assert out.token_ids == out.outputs[0].token_ids and out.text == out.outputs[0].text
        singles = [single.generate([prompt], seeded(seed + j), use_tqdm=False)[0] for j in range(4)]
        assert [c.token_ids for c in out.outputs] == [s.token_ids for s in singles]
        assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(
            [s.outputs[0].cumulative_logprob for s in singles], abs=1e-5)
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "the completions should differ"
    if pool == 12:
        assert llm.get_metrics().num_preemptions > 0
    assert llm.block_manager.num_free_blocks == pool


def test_parallel_sampling_shares_the_prompt_blocks():
    llm = LLM(MODEL, block_size=4, num_kvcache_blocks=64, **CPU)
    rid = llm.add_request(PROMPT, SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=5, ignore_eos=True))
    llm.step()                                   # prefill: 9 tokens, 3 blocks, then the fork
    root = llm.get_sequence(rid)
    assert len(root.children) == 2
    assert all(c.block_table == root.block_table for c in root.children)
    assert [llm.block_manager.blocks[b].ref_count for b in root.block_table] == [3, 3, 3]
    llm.step()                                   # decode: two of three copy the partial block
    tables = [root.block_table] + [c.block_table for c in root.children]
    assert len({t[-1] for t in tables}) == 3 and len({t[0] for t in tables}) == 1
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.block_manager.num_free_blocks == 64


def test_greedy_n_gives_n_equal_completions_and_n1_code_is_unchanged():
    llm = LLM(MODEL, block_size=4, num_kvcache_blocks=64, **CPU)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    [one] = llm.generate([PROMPT], greedy, use_tqdm=False)
    [many] = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, n=3),
                          use_tqdm=False)
    assert len(one.outputs) == 1 and [c.token_ids for c in many.outputs] == [one.token_ids] * 3


def test_abort_of_a_forked_request_frees_every_completion():
    llm = LLM(MODEL, block_size=4, num_kvcache_blocks=64, **CPU)
    rid = llm.add_request(PROMPT, SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=8, ignore_eos=True))
    for _ in range(3):
        llm.step()
    out = llm.abort_request(rid)
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert llm.block_manager.num_free_blocks == 64 and llm.is_finished()


@pytest.mark.parametrize("make, message", [
    (lambda: SamplingParams(n=0), "n must be an integer >= 1"),
    (lambda: SamplingParams(n=True), "n must be an integer"),
    (lambda: BeamSearchParams(beam_width=0, max_tokens=4), "beam_width"),
    (lambda: BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5), "temperature must be 0"),
])
def test_bad_fork_settings(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_n_or_beam_width_too_large_for_the_pool_is_refused_before_anything_runs():
    llm = LLM(MODEL, block_size=4, num_kvcache_blocks=10, **CPU)
    # 9 + 8 tokens, 16 stored: 2 full prompt blocks shared, 2 more for each completion.
    params = SamplingParams(n=5, max_tokens=8, ignore_eos=True)          # 2 + 5 x 2 = 12 > 10
    with pytest.raises(ValueError, match="can never fit"):
        llm.generate([PROMPT], params, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0: .*can never fit"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=5, max_tokens=8))
    assert llm.is_finished() and llm.block_manager.num_free_blocks == 10
    [ok] = llm.generate([PROMPT], SamplingParams(n=4, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(ok.outputs) == 4                                           # 2 + 4 x 2 = 10 fits
    [beams] = llm.beam_search([PROMPT], BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True))
    assert len(beams.sequences) == 4 and llm.block_manager.num_free_blocks == 10


# ---------------------------------------------------------------- beam search against Hugging Face

@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    return build_random_checkpoint(tmp_path_factory.mktemp("beams") / "random", seed=5, vocab_size=512,
                                   hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256)


def hf_beams(path, prompt, k, max_tokens, eos):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=k, num_return_sequences=k,
                             do_sample=False, max_new_tokens=max_tokens, pad_token_id=0, eos_token_id=eos,
                             output_scores=True, return_dict_in_generate=True)
    seqs = [s[len(prompt):].tolist() for s in out.sequences]
    return seqs, (out.sequences_scores.tolist() if k > 1 else None)


@pytest.mark.parametrize("which", ["shipped", "random"])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("ignore_eos", [True, False], ids=["no-eos", "eos"])
def test_beam_search_equals_hugging_face(which, k, ignore_eos, random_model):
    path = MODEL if which == "shipped" else random_model
    rng = random.Random(k)
    prompt = PROMPT if which == "shipped" else [rng.randrange(1, 512) for _ in range(11)]
    max_tokens = 8
    llm = LLM(path, block_size=4, num_kvcache_blocks=64, **CPU)
    eos = sorted(llm.scheduler.eos_token_ids)
    [out] = llm.beam_search([prompt], BeamSearchParams(beam_width=k, max_tokens=max_tokens, ignore_eos=ignore_eos))
    hf_seqs, hf_scores = hf_beams(path, prompt, k, max_tokens, None if ignore_eos else eos)
    ours = [s.tokens[len(prompt):] for s in out.sequences]
    assert [s.tokens[:len(prompt)] for s in out.sequences] == [prompt] * k
    # HF pads finished hypotheses to the longest one; compare each up to its own length.
    assert ours == [h[:len(o)] for h, o in zip(hf_seqs, ours)]
    if hf_scores is not None:
        assert [s.score for s in out.sequences] == pytest.approx(hf_scores, abs=1e-4)
        # cum_logprob is the unnormalised sum: score * generated_length ** length_penalty
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(
            [sc * len(o) for sc, o in zip(hf_scores, ours)], abs=1e-4)
    if ignore_eos:
        assert all(len(o) == max_tokens and s.finish_reason == "length" for o, s in zip(ours, out.sequences))
    assert llm.block_manager.num_free_blocks == 64


def test_beam_search_is_a_request_of_the_step_loop():
    """A search queued with add_beam_search runs through step(): every step schedules all its
    live beams together, and its output's completions are the hypotheses of beam_search."""
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    llm = LLM(MODEL, block_size=4, num_kvcache_blocks=40, **CPU)
    [want] = llm.beam_search([PROMPT], params)
    rid = llm.add_beam_search(PROMPT, params)
    with pytest.raises(RuntimeError, match="runs alone"):
        llm.add_request(PROMPT, SamplingParams(max_tokens=2))
    search = llm.scheduler.beam_searches[rid]
    outputs, steps = [], 0
    while not outputs:
        live = sorted(b.seq_id for b in search.beams)
        outputs = llm.step()
        steps += 1
        assert sorted(seq_id for seq_id, _, _ in llm.last_step.scheduled) == live
    [out] = outputs
    assert out.request_id == rid and steps == len(search.steps)
    assert [c.token_ids for c in out.outputs] == [h.tokens[len(PROMPT):] for h in want.sequences]
    # (approximately: the second search's prompt comes from the prefix cache, computed apart)
    assert [c.cumulative_logprob for c in out.outputs] == pytest.approx([h.cum_logprob for h in want.sequences], abs=1e-5)
    assert [c.text for c in out.outputs] == [h.text for h in want.sequences]
    assert not llm.scheduler.beam_searches and llm.block_manager.num_free_blocks == 40
    # ... and the other way round: a search waits for the queue to empty.
    llm.add_request(PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="runs alone"):
        llm.add_beam_search(PROMPT, params)


def test_beam_search_with_chunked_prefill_equals_hugging_face(random_model):
    """The root's prompt computed in chunks of 4 tokens (and found in the prefix cache by the
    second search): the same hypotheses as Hugging Face's."""
    prompt = [random.Random(7).randrange(1, 512) for _ in range(11)]
    llm = LLM(random_model, block_size=4, num_kvcache_blocks=64, max_num_batched_tokens=4, **CPU)
    params = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    hf_seqs, hf_scores = hf_beams(random_model, prompt, 2, 6, None)
    for _ in range(2):
        [out] = llm.beam_search([prompt], params)
        assert [s.tokens[len(prompt):] for s in out.sequences] == hf_seqs
        assert [s.score for s in out.sequences] == pytest.approx(hf_scores, abs=1e-4)
    assert llm.block_manager.prefix_cache_stats.hits > 0


def test_aborting_a_beam_search_aborts_every_beam():
    llm = LLM(MODEL, block_size=4, num_kvcache_blocks=40, **CPU)
    rid = llm.add_beam_search(PROMPT, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    for _ in range(3):
        assert llm.step() == []
    beams = list(llm.scheduler.beam_searches[rid].beams)
    assert len(beams) == 3 and llm.block_manager.num_free_blocks < 40
    out = llm.abort_request(rid)
    assert out.request_id == rid and len(out.outputs) == 0   # (no hypothesis had ended yet)
    assert all(b.finish_reason == "abort" for b in beams)
    assert not llm.has_unfinished_requests() and not llm.scheduler.beam_searches
    check_invariants(llm.block_manager, [])


def test_a_step_without_the_beams_candidates_is_refused_and_undone():
    """The scheduler alone, as a runner would drive it: results without top_logprobs (or with
    malformed ones) are refused by name, the whole step is undone (schedule's part too), and
    the same step comes again."""
    from course_pkg.engine.outputs import ModelRunnerOutput
    from course_pkg.scheduler import Scheduler

    sched = Scheduler(16, 4, eos_token_id=0)
    root = Sequence(list(range(1, 7)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), block_size=4)
    sched.add_beam_search(root, BeamSearchParams(beam_width=2, max_tokens=3))
    before = state(sched.block_manager, [root])
    out = sched.schedule()
    assert out.num_logprobs == (4,)
    for bad, words in [(None, "top_logprobs"), ([[]], "1 to 4"), ([[(5, 0.0)] * 5], "1 to 4"),
                       ([[(5, "x")]], "pairs")]:
        with pytest.raises(ValueError, match=words):
            sched.update_from_output(out, ModelRunnerOutput([[5]], [[-0.1]], top_logprobs=bad))
        assert state(sched.block_manager, [root]) == before and root.num_cached_tokens == 0
        out = sched.schedule()
    rows = [[(5, -0.5), (6, -1.0), (7, -2.0), (8, -3.0)]]
    assert sched.update_from_output(out, ModelRunnerOutput([[5]], [[-0.5]], top_logprobs=rows)) == []
    [a, b] = sched.beam_searches[root.request_id].beams
    assert (a.token_ids[-1], b.token_ids[-1]) == (5, 6) and a is root and b.parent is root
    assert sched.block_manager.blocks[root.block_table[-1]].ref_count == 2   # the partial block, shared


def test_beams_share_blocks_and_pruned_beams_free_theirs():
    llm = LLM(MODEL, block_size=4, num_kvcache_blocks=64, **CPU)
    trace = []

    def on_step(step, beams):
        held = {b for beam in beams for b in beam.block_table}
        trace.append((step, len(beams), len(held), sum(len(beam.block_table) for beam in beams)))
        # (between steps: a beam's new token gets its block -- or its copy -- in the next schedule)
        check_invariants(llm.block_manager, beams, between_steps=True)

    llm.beam_search([PROMPT], BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True), on_step=on_step)
    assert [step.step for step, *_ in trace] == [1, 2, 3, 4, 5, 6]
    assert [n for _, n, _, _ in trace] == [4, 4, 4, 4, 4, 0]   # the last step ends every hypothesis
    assert all(distinct < entries for _, _, distinct, entries in trace[:-1]), "beams should share blocks"
    assert sum(len(step.copies) for step, *_ in trace) > 0, "a fork's shared partial block is copied on write"
    assert llm.block_manager.num_free_blocks == 64
