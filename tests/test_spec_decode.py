"""Speculative decoding (chapter 14): drafts change the cost of a step, never what it yields.

* Greedy: with n-gram drafts and with early-exit drafts, every output equals Hugging Face's
  greedy output token for token -- under prefix caching, chunked prefill, preemption by
  recompute and by swap, both admission policies, block sizes 1 and 4 -- on the shipped tiny
  model and on a random one.
* Under the same engine options, after every step no table keeps a rolled-back tail and no
  block holding an unverified token is registered; after every decode-only step the block state
  equals the state of a non-speculative block manager that computed the accepted tokens: the
  same tables, ref counts, registered hashes and free-block count, up to the renaming of block
  ids, and the same cached prefixes in free blocks but those lookahead took (taking a freed
  block that still caches a prefix drops its entry, as any allocation does).
* A seeded request with n-gram drafts yields the tokens it yields without speculation, in any
  batch and pool; n-gram drafts are proposed before their slots are taken.
* Sampling: rejection sampling's outputs follow the target's distribution (a chi-square test
  on a small vocabulary, seeded), and the same test rejects a broken rule; in the engine, on a
  random model of 8 tokens, sampled outputs follow the probabilities Hugging Face computes.
* Faults injected in the draft, in the verification and in the rollback undo the step, and the
  run continues with exactly the tokens of a run without faults.
"""
from __future__ import annotations

import copy
import random
from collections import Counter
from dataclasses import astuple
from pathlib import Path

import pytest
import torch

from course_pkg import LLM, BlockManager, SamplingParams, Sequence
from course_pkg.sequence import SequenceStatus
from course_pkg.engine import EngineConfig
from course_pkg.engine import spec_decode
from course_pkg.engine.spec_decode import NgramProposer, SpeculativeConfig, greedy_accept, rejection_sample
from course_pkg.models import build_random_checkpoint, default_model_path, load_tokenizer
from course_pkg.sampling_params import BeamSearchParams
from course_pkg.scheduler import STEP_STATE
from course_pkg.undo import transaction
from tests.helpers import Fault, check_invariants, state
from tests.test_step_transaction import compare, snapshot

MODEL = default_model_path()
CORPUS = Path(__file__).resolve().parents[1] / "tools" / "tiny_model_corpus.txt"
CPU = dict(device="cpu", dtype=torch.float32, attention_backend="torch")
GREEDY = dict(temperature=0.0, ignore_eos=True)
NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
DRAFT = dict(method="early_exit", num_speculative_tokens=3, num_draft_layers=2)
METHODS = {"ngram": NGRAM, "early_exit": DRAFT}


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """One torch thread for this module (see conftest)."""


def make_prompts(vocab_size: int) -> list[list[int]]:
    """Random prompts, two sharing a prefix, and two that repeat a phrase (n-gram drafts hit)."""
    rng = random.Random(22)

    def tokens(n):
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    shared, phrase = tokens(9), tokens(4)
    return [tokens(3), tokens(11), shared + tokens(2), shared + tokens(7), phrase * 4, tokens(2) + phrase * 3]


def text_prompts() -> list[list[int]]:
    """For the tiny model, which recalls the course's prose: passages of its corpus that come
    back to their own beginning (its continuation then repeats the prompt: n-gram drafts hit),
    two of them sharing a prefix, and two random prompts."""
    paras = [p.split() for p in CORPUS.read_text().split("\n\n") if p.strip()]
    texts = [" ".join(paras[0][:30] + paras[0][:4]), " ".join(paras[0][:30] + paras[0][8:11]),
             " ".join(paras[3][:25] + paras[3][:3]), " ".join(paras[1][:12])]
    tok = load_tokenizer(MODEL)
    return [tok.encode(t, add_special_tokens=False) for t in texts] + make_prompts(1024)[:2]


def max_tokens_for(i: int) -> int:
    return 10 + (i * 5) % 9     # 10 .. 18


def params_for(prompts):
    return [SamplingParams(max_tokens=max_tokens_for(i), **GREEDY) for i in range(len(prompts))]


def hf_greedy(path, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = []
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens_for(i), pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    return build_random_checkpoint(tmp_path_factory.mktemp("spec") / "random", seed=3, vocab_size=512,
                                   hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256)


@pytest.fixture(scope="module")
def cases(random_model):
    """Per model: (path, prompts, Hugging Face's greedy tokens)."""
    out = {}
    for name, path in (("tiny", MODEL), ("random", random_model)):
        prompts = make_prompts(512) if name == "random" else text_prompts()
        out[name] = (path, prompts, hf_greedy(path, prompts))
    return out


# ---------------------------------------------------------------- greedy: equal to Hugging Face

CONFIGS = {
    "prefix-caching": dict(block_size=4, num_kvcache_blocks=128),
    "chunked-mixed-same-step": dict(block_size=4, num_kvcache_blocks=128, max_num_batched_tokens=9,
                                    scheduling="mixed", same_step_prefix_hits=True),
    "preempt-recompute": dict(block_size=4, num_kvcache_blocks=18),
    "preempt-swap-mixed": dict(block_size=4, num_kvcache_blocks=15, preemption_mode="swap", num_cpu_blocks=24,
                               scheduling="mixed", max_num_batched_tokens=16),
    "bs1-no-caching": dict(block_size=1, num_kvcache_blocks=400, enable_prefix_caching=False),
}


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_speculation_equals_huggingface(cases, config, method):
    path, prompts, expected = cases["tiny"]
    llm = LLM(path, **CPU, **CONFIGS[config], speculative_config=METHODS[method])
    outs = llm.generate(prompts, params_for(prompts), use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.token_ids == expected[i], f"prompt {i} differs from HF"
    m = llm.get_metrics()
    assert m.generation_tokens == sum(map(len, expected))
    assert m.spec_decode_num_drafts > 0 and m.spec_decode_num_accepted_tokens > 0
    assert m.kv_cache_usage_perc == 0 and m.num_requests_running == 0
    check_invariants(llm.block_manager, [])
    if "preempt" in config:
        assert m.num_preemptions > 0
    if "swap" in config:
        assert m.num_swapped_out > 0


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("config", ["prefix-caching", "preempt-swap-mixed"])
def test_greedy_speculation_equals_huggingface_on_a_random_model(cases, config, method):
    path, prompts, expected = cases["random"]
    spec = dict(METHODS[method], **({"num_draft_layers": 1} if method == "early_exit" else {}))
    llm = LLM(path, **CPU, **CONFIGS[config], speculative_config=spec)
    outs = llm.generate(prompts, params_for(prompts), use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    assert llm.get_metrics().spec_decode_num_accepted_tokens > 0


def test_a_request_stops_inside_the_accepted_drafts():
    """max_tokens and the end-of-sequence token end a request in the middle of what verification
    accepted: the tokens after it are dropped, as without speculation."""
    prompts = text_prompts()
    base = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=64)
    spec = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=64,
               speculative_config=dict(NGRAM, num_speculative_tokens=5))
    for max_tokens in (1, 2, 3, 7):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)   # (the tiny model's EOS may come)
        want = [(o.token_ids, o.finish_reason) for o in base.generate(prompts, sp, use_tqdm=False)]
        assert [(o.token_ids, o.finish_reason) for o in spec.generate(prompts, sp, use_tqdm=False)] == want
    check_invariants(spec.block_manager, [])


# ---------------------------------------------------------------- the block state after every step


def canonical(bm: BlockManager, seqs) -> tuple:
    """The block state up to the names of blocks: tables renamed by first use, their ref counts,
    each sequence's hashes and counts, the registered hashes of held blocks, the free count and
    the hashes still cached in free blocks."""
    names: dict[int, int] = {}
    tables = []
    for s in sorted(seqs, key=lambda s: s.seq_id):
        for b in s.block_table:
            names.setdefault(b, len(names))
        tables.append((s.seq_id, tuple(s.token_ids), tuple(names[b] for b in s.block_table),
                       tuple(s.block_hashes), s.num_cached_tokens))
    refs = tuple(bm.blocks[b].ref_count for b in names)
    held_index = sorted((h, names[b]) for h, b in bm.hash_to_block_id.items() if b in names)
    free_cached = sorted(bm.blocks[b].hash for b in bm.free_block_ids if bm.blocks[b].hash != -1)
    return tuple(tables), refs, tuple(held_index), len(bm.free_block_ids), tuple(free_cached)


def non_speculative(bm_before: BlockManager, seqs_before, after_seqs, finished_ids) -> tuple:
    """What a non-speculative engine's blocks hold once it has computed the same tokens: each
    accepted token is appended as a plain decode step would (a slot for the newest token, then
    register what became full)."""
    by_id = {s.seq_id: s for s in seqs_before}
    for real in after_seqs:
        ref = by_id[real.seq_id]
        for t in real.token_ids[ref.num_tokens:]:
            bm_before.may_append(ref)
            ref.num_cached_tokens = ref.num_tokens
            ref.append_token(t)
            bm_before.hash_blocks(ref)
    for sid in finished_ids:
        bm_before.deallocate(by_id[sid])
    return canonical(bm_before, [s for s in seqs_before if s.seq_id not in finished_ids])


def free_cached_hashes(bm) -> Counter:
    return Counter(bm.blocks[b].hash for b in bm.free_block_ids if bm.blocks[b].hash != -1)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("config", [c for c in CONFIGS if c != "bs1-no-caching"])
def test_after_every_step_the_blocks_are_those_of_a_non_speculative_engine(config, method):
    """Under every engine option (prefix caching, chunked prefill with same-step hits, preemption
    by recompute and by swap, both policies): after every step no table keeps a rolled-back
    tail, no block holding a rejected token is registered, ref counts and the free queue agree;
    and after every step that only decodes (nothing waits, nobody is preempted) the block state
    is that of a non-speculative block manager that computed the accepted tokens -- except the
    cached prefixes of free blocks that lookahead took (and evicted, as any allocation does)."""
    prompts = text_prompts()
    llm = LLM(MODEL, **CPU, **CONFIGS[config], speculative_config=METHODS[method])
    bm, sched = llm.block_manager, llm.scheduler
    bs = bm.block_size
    freed, evicted = [], Counter()
    real_free, real_take = bm.free_lookahead_slots, bm.allocate_lookahead_slots
    bm.free_lookahead_slots = lambda seq: freed.extend(real_free(seq)) or []

    def take(seq, n):
        cached = {b: bm.blocks[b].hash for b in bm.free_block_ids if bm.blocks[b].hash != -1}
        got = real_take(seq, n)
        evicted.update(h for b, h in cached.items() if b in seq.block_table)
        return got

    bm.allocate_lookahead_slots = take
    for p, sp in zip(prompts, params_for(prompts)):
        llm.add_request(p, sp)
    compared = checked = 0
    while llm.has_unfinished_requests():
        live = list(sched.running)
        decode_only = bool(live) and not sched.waiting
        ref_bm, ref_seqs = copy.deepcopy((bm, live)) if decode_only else (None, None)
        preemptions = llm.get_metrics().num_preemptions
        evicted.clear()
        llm.step()
        running = list(sched.running)
        for s in running:
            if s.num_cached_tokens == s.num_tokens - 1:      # decoding: nothing past its last verified token
                assert len(s.block_table) == -(-s.num_cached_tokens // bs), f"{s.seq_id} kept a rolled-back tail"
            assert len(s.block_hashes) * bs <= s.num_cached_tokens, "a block with an unverified token is registered"
        # Every holder of device blocks: the running, and waiting ones a chunked prefill started
        # (a swapped sequence holds CPU blocks only).
        holders = running + [s for s in sched.waiting if s.status != SequenceStatus.SWAPPED and s.block_table]
        assert set(bm.free_block_ids) == set(range(bm.num_blocks)) - bm.used_block_ids
        assert sum(b.ref_count for b in bm.blocks) == sum(len(s.block_table) for s in holders)
        checked += 1
        if not decode_only or llm.get_metrics().num_preemptions != preemptions:
            continue
        finished = {s.seq_id for s in live if s.is_finished}
        still = [s for s in live if not s.is_finished]
        tables, refs, index, num_free, _ = canonical(bm, still)
        want_tables, want_refs, want_index, want_free, want_cached = non_speculative(ref_bm, ref_seqs, live, finished)
        assert (tables, refs, index, num_free) == (want_tables, want_refs, want_index, want_free), \
            f"step {llm.last_step.step}"
        lost = Counter(want_cached) - free_cached_hashes(bm)
        assert not free_cached_hashes(bm) - Counter(want_cached) and not lost - evicted, f"step {llm.last_step.step}"
        compared += 1
    assert compared > 5 and checked > compared and freed, "decode steps compared; some rollback gave a block back"
    assert ("preempt" not in config) or llm.get_metrics().num_preemptions > 0
    check_invariants(bm, [])


def test_lookahead_slots_take_free_blocks_only_and_give_back_to_the_head():
    bm = BlockManager(6, 4, free_queue="linked")
    seq = Sequence(list(range(10, 16)), block_size=4)       # 6 tokens: 2 blocks
    bm.allocate(seq, bm.can_allocate(seq))
    other = Sequence(list(range(30, 38)), block_size=4)     # 2 more blocks
    bm.allocate(other, bm.can_allocate(other))
    head = list(bm.free_block_ids)
    assert len(head) == 2
    assert bm.allocate_lookahead_slots(seq, 1) == 1 and len(seq.block_table) == 2   # slot 6 is in block 1
    assert bm.allocate_lookahead_slots(seq, 20) == 10                               # 2 blocks: 8 + 2 slots
    assert list(bm.free_block_ids) == [] and seq.block_table[2:] == head
    # Verification accepted 3 drafts (positions 6, 7, 8) and added the target's next token.
    for t in (1, 2, 3, 4):
        seq.append_token(t)
    seq.num_cached_tokens = 9                           # positions 0 .. 8 hold verified K/V
    assert bm.free_lookahead_slots(seq) == head[1:]    # block 2 keeps position 8; block 3 had only drafts
    assert list(bm.free_block_ids) == head[1:] and len(seq.block_table) == 3
    bm.hash_blocks(seq)
    assert len(seq.block_hashes) == 2                  # block 2 is not full: not registered
    assert bm.may_append(seq) == [] and len(seq.block_table) == 3      # the newest token (9) has its slot
    check_invariants(bm, [seq, other])
    before = state(bm, [seq])
    with pytest.raises(RuntimeError, match="boom"):
        with transaction(bm, seq, follow=STEP_STATE):
            bm.allocate_lookahead_slots(seq, 8)
            bm.free_lookahead_slots(seq)
            raise RuntimeError("boom")
    assert state(bm, [seq]) == before


def test_a_draft_that_cannot_get_a_block_is_not_proposed():
    """A pool too small for both requests at their longest: lookahead gets fewer slots than asked
    for, preempts nobody (no more preemptions than without speculation), and the output is unchanged.
    (The early-exit draft asks for k slots before it proposes; n-gram asks only for its drafts.)"""
    prompts = [text_prompts()[i] for i in (0, 3)]    # 13 + 6 blocks of 4 at their longest; the pool has 18
    sp = SamplingParams(max_tokens=12, **GREEDY)
    base = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=18)
    want = [o.token_ids for o in base.generate(prompts, sp, use_tqdm=False)]
    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=18,
              speculative_config=dict(DRAFT, num_speculative_tokens=8))
    granted = []
    real = llm.block_manager.allocate_lookahead_slots
    llm.block_manager.allocate_lookahead_slots = lambda s, n: granted.append((n, real(s, n))) or granted[-1][1]
    assert [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == want
    assert any(got < asked for asked, got in granted), "the pool ran short of lookahead blocks"
    # Lookahead never preempts (fewer steps may even need fewer preemptions than without it).
    assert llm.get_metrics().num_preemptions <= base.get_metrics().num_preemptions
    check_invariants(llm.block_manager, [])


# ---------------------------------------------------------------- proposers and acceptance rules


def test_ngram_proposer_takes_the_longest_suffix_and_its_earliest_occurrence():
    p = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=3)
    assert p.propose([1, 2, 3, 4, 2, 3], 4) == [4, 2, 3]          # vLLM's docstring example
    assert p.propose([1, 2, 3, 4, 2, 3], 1) == [4]
    assert p.propose([7, 8, 9, 5, 8, 9, 6, 7, 8, 9], 2) == [5, 8]  # [7, 8, 9] beats [8, 9]
    assert p.propose([5, 1, 2, 6, 1, 2, 7, 1, 2], 1) == [6]        # earliest of two [1, 2]
    assert p.propose([1, 2, 3, 4], 3) == []                        # nothing repeats
    assert NgramProposer(1, 1).propose([4, 4], 3) == [4]


def test_greedy_accept_keeps_the_agreeing_prefix_and_the_targets_next_token():
    assert greedy_accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert greedy_accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert greedy_accept([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert greedy_accept([], [3]) == [3]


V = 5


def two_token_target(seed):
    """A target over 2 tokens: p0(a), p1(b | a); drafts q0(a), q1(b | a) -- all different."""
    g = torch.Generator().manual_seed(seed)

    def dist(*shape):
        return torch.softmax(torch.randn(*shape, V, generator=g) * 1.5, dim=-1)

    return dist(), dist(V), dist(V, V), dist(), dist(V)   # p0, p1[a], p2[a, b], q0, q1[a]


def first_two_tokens(accept, trials, seed):
    """Sample the first two tokens with drafts and an acceptance rule; their joint counts."""
    p0, p1, p2, q0, q1 = two_token_target(seed)
    g = torch.Generator().manual_seed(seed + 1)
    counts = torch.zeros(V, V)
    for _ in range(trials):
        x1 = int(torch.multinomial(q0, 1, generator=g))
        x2 = int(torch.multinomial(q1[x1], 1, generator=g))
        out = accept([x1, x2], torch.stack([q0, q1[x1]]), torch.stack([p0, p1[x1], p2[x1, x2]]), g)
        if len(out) == 1:    # the next step samples the second token from the target
            out.append(int(torch.multinomial(p1[out[0]], 1, generator=g)))
        counts[out[0], out[1]] += 1
    return counts, (p0[:, None] * p1).flatten()


def chi_square_p_value(counts, probs, min_expected=5.0):
    """Pearson's chi-square test of counts against probabilities. The test's approximation needs
    about 5 expected counts per cell, so the rarest cells are pooled into one until it expects
    at least ``min_expected`` (every cell expecting fewer is in it)."""
    counts, expected = counts.flatten().double(), probs.flatten().double() * counts.sum()
    order = expected.argsort()
    pooled = max(int((expected < min_expected).sum()), int((expected[order].cumsum(0) < min_expected).sum()) + 1)
    rare, rest = order[:pooled], order[pooled:]
    observed = torch.cat([counts[rare].sum(0, keepdim=True), counts[rest]])
    expected = torch.cat([expected[rare].sum(0, keepdim=True), expected[rest]])
    assert expected.min() >= min_expected and len(observed) >= 2
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(len(observed) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def test_the_chi_square_test_pools_rare_cells_and_tells_a_fair_die_from_a_loaded_one():
    probs = torch.tensor([0.5, 0.3, 0.19, 0.005, 0.005])       # 200 throws expect 1 of each of the last two
    g = torch.Generator().manual_seed(0)
    throws = lambda p: torch.bincount(torch.multinomial(p, 200, replacement=True, generator=g), minlength=5).float()
    p_values = [chi_square_p_value(throws(probs), probs) for _ in range(40)]
    assert min(p_values) > 1e-4 and sum(p < 0.5 for p in p_values) in range(10, 31)   # about uniform
    assert chi_square_p_value(throws(torch.tensor([0.3, 0.5, 0.19, 0.005, 0.005])), probs) < 1e-3


def broken_rejection_sample(draft_token_ids, draft_probs, target_probs, generator=None):
    """A plausible bug: on rejection, resample from the target instead of the residual max(0, p - q)."""
    for i, x in enumerate(draft_token_ids):
        p, q = target_probs[i], draft_probs[i]
        if torch.rand((), generator=generator) * q[x] < p[x]:
            continue
        return draft_token_ids[:i] + [int(torch.multinomial(p, 1, generator=generator))]
    return draft_token_ids + [int(torch.multinomial(target_probs[-1], 1, generator=generator))]


@pytest.mark.parametrize("seed", range(3))
def test_rejection_sampling_follows_the_target_distribution_and_a_broken_rule_does_not(seed):
    """Three made-up targets (seeds), 3,000 draws each; the rarest pairs pooled."""
    counts, probs = first_two_tokens(rejection_sample, 3000, seed=seed)
    assert chi_square_p_value(counts, probs) > 1e-3
    counts, probs = first_two_tokens(broken_rejection_sample, 3000, seed=seed)
    assert chi_square_p_value(counts, probs) < 1e-6


def test_rejection_sampling_with_a_point_mass_draft_accepts_with_the_targets_probability():
    """An n-gram draft is certain (q = 1 on it): accepted with probability p(draft), else the
    target's token given that it is not the draft."""
    p = torch.tensor([[0.5, 0.2, 0.3], [0.1, 0.1, 0.8]])
    g = torch.Generator().manual_seed(4)
    outs = [tuple(rejection_sample([0], None, p, g)) for _ in range(4000)]
    accepted = sum(o[0] == 0 for o in outs) / len(outs)
    assert abs(accepted - 0.5) < 0.03
    rejected = [o[0] for o in outs if o[0] != 0]
    assert abs(rejected.count(2) / len(rejected) - 0.6) < 0.04 and all(len(o) == 1 for o in outs if o[0] != 0)


def test_sampled_speculation_is_reproducible_and_leaves_the_prefill_token_alone():
    """Seeded requests give the same tokens in two runs; the first token, sampled by the prefill
    before any draft, is the non-speculative engine's (the same generator draws it)."""
    prompts = text_prompts()
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True, seed=7)
    plain = [o.token_ids for o in LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=128).generate(
        prompts, sp, use_tqdm=False)]
    for spec in (NGRAM, DRAFT):
        runs = [[o.token_ids for o in LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=128,
                                          speculative_config=spec).generate(prompts, sp, use_tqdm=False)]
                for _ in range(2)]
        assert runs[0] == runs[1]
        assert [r[0] for r in runs[0]] == [r[0] for r in plain]
        assert all(len(r) == 12 for r in runs[0])


def test_a_seeded_request_with_ngram_drafts_yields_its_tokens_without_speculation_in_any_batch():
    """A seeded request draws one Exp(1) vector per token whether or not it speculates (a certain
    draft is accepted when it is the target's own sample), so its tokens are those of a plain
    engine run alone: with other requests, in pools so small that the slots it gets (and the
    preemptions) vary, by recompute and by swap. (The early-exit draft's sampled drafts draw
    from the request's generator too: its tokens depend on the drafts it got; see the sampler.)"""
    prompts = text_prompts()[:3]
    seeded = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=3)
    other = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=5)
    alone = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=200).generate(
        prompts[:1], seeded, use_tqdm=False)[0].token_ids
    seen = set()
    for blocks, mode in ((200, "recompute"), (30, "recompute"), (30, "swap")):
        extra = dict(preemption_mode="swap", num_cpu_blocks=100) if mode == "swap" else {}
        llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=blocks, **extra,
                  speculative_config=dict(NGRAM, num_speculative_tokens=4))
        outs = llm.generate(prompts, [seeded, other, other], use_tqdm=False)
        assert outs[0].token_ids == alone, (blocks, mode)
        m = llm.get_metrics()
        assert m.spec_decode_num_accepted_tokens > 0
        seen.add((m.num_preemptions > 0, m.spec_decode_num_draft_tokens))
    assert len(seen) == 3 and any(p for p, _ in seen), "the runs differ in drafts and preemptions"


def test_ngram_drafts_are_proposed_before_their_slots_are_taken():
    """The scheduler runs the n-gram proposer first: every lookahead slot carries a draft, and a
    sequence whose n-gram has no earlier occurrence takes no lookahead block."""
    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=128, speculative_config=NGRAM)
    steps = []
    real = llm.model_runner.execute_model

    def spy(out, *args, **kwargs):
        result = real(out, *args, **kwargs)
        steps.append((out, result))
        return result

    llm.model_runner.execute_model = spy
    llm.generate(text_prompts(), params_for(text_prompts()), use_tqdm=False)
    slots = drafted = undrafted = 0
    for out, result in steps:
        if not out.num_lookahead_tokens:
            continue
        for i, n in enumerate(out.num_lookahead_tokens):
            assert n == len(out.scheduled_spec_decode_tokens[i])
            if n:
                assert len(result.draft_token_ids[i]) == n
            slots += n
            drafted += n > 0
            undrafted += n == 0 and out.num_scheduled_tokens[i] == 1
    assert slots and drafted and undrafted


def test_a_rejected_draft_whose_residual_rounds_to_zero_falls_back_to_the_target():
    """max(0, p - q) can be all zero in float32 (p <= q everywhere after rounding); the token then
    comes from p, never the rejected draft by default (argmax of zeros is token 0)."""
    p = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    q = torch.tensor([[0.5, 1.0]])               # q >= p everywhere: the residual is all zero
    for seed in range(20):
        assert rejection_sample([0], q, p, torch.Generator().manual_seed(seed)) == [1]


def test_sampled_speculation_in_the_engine_follows_the_models_distribution(tmp_path_factory):
    """3,000 requests of one prompt on a random model of 8 tokens: the first two tokens (the second
    one drafted and verified by rejection sampling) against the joint probabilities Hugging Face
    computes, by a chi-square test, for both proposers (the n-gram's certain drafts and the
    early-exit draft's distribution q)."""
    from transformers import AutoModelForCausalLM
    path = build_random_checkpoint(tmp_path_factory.mktemp("spec8") / "v8", seed=2, vocab_size=8, hidden_size=32,
                                   intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                                   initializer_range=0.1)
    prompt = [1, 2, 3, 4, 1, 2, 3]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
        p2 = torch.stack([torch.softmax(hf(torch.tensor([prompt + [a]])).logits[0, -1], -1) for a in range(8)])
    probs = (p1[:, None] * p2).flatten()
    for spec in (dict(NGRAM, num_speculative_tokens=2, prompt_lookup_max=2), dict(DRAFT, num_draft_layers=1,
                                                                                  num_speculative_tokens=2)):
        llm = LLM(path, **CPU, block_size=4, num_kvcache_blocks=9000, max_num_seqs=512, seed=1,
                  speculative_config=spec)
        outs = llm.generate([prompt] * 3000, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
                            use_tqdm=False)
        counts = torch.zeros(64)
        for o in outs:
            counts[o.token_ids[0] * 8 + o.token_ids[1]] += 1
        assert llm.get_metrics().spec_decode_num_drafts > 1000
        assert chi_square_p_value(counts, probs) > 1e-3       # the rarest pairs pooled


# ---------------------------------------------------------------- metrics


def test_metrics_count_drafts_and_acceptances_under_vllms_names():
    prompts = text_prompts()
    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=128, speculative_config=NGRAM)
    seen = []
    real = llm.model_runner.execute_model

    def execute(out):
        result = real(out)
        seen.append(result)
        return result

    llm.model_runner.execute_model = execute
    llm.generate(prompts, params_for(prompts), use_tqdm=False)
    drafts = [(d, t) for r in seen if r.draft_token_ids for d, t in zip(r.draft_token_ids, r.sampled_token_ids) if d]
    accepted = [len(t) - 1 for _, t in drafts]
    m = llm.get_metrics()
    assert m.spec_decode_num_drafts == len(drafts) > 0
    assert m.spec_decode_num_draft_tokens == sum(len(d) for d, _ in drafts)
    assert m.spec_decode_num_accepted_tokens == sum(accepted) > 0
    assert list(m.spec_decode_num_accepted_tokens_per_pos) == [sum(a > i for a in accepted) for i in range(3)]
    assert m.spec_decode_mean_acceptance_length == 1 + sum(accepted) / len(drafts)
    reg = llm.metrics_registry
    labels = {"model_name": "tiny", "engine": "0"}
    assert reg.get_sample_value("vllm:spec_decode_num_drafts_total", labels) == m.spec_decode_num_drafts
    assert reg.get_sample_value("vllm:spec_decode_num_draft_tokens_total", labels) == m.spec_decode_num_draft_tokens
    assert reg.get_sample_value("vllm:spec_decode_num_accepted_tokens_total", labels) == sum(accepted)
    for pos, n in enumerate(m.spec_decode_num_accepted_tokens_per_pos):
        assert reg.get_sample_value("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                    dict(labels, position=str(pos))) == n
    plain = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=16)
    assert plain.metrics_registry.get_sample_value("vllm:spec_decode_num_drafts_total", labels) is None


# ---------------------------------------------------------------- what is refused


@pytest.mark.parametrize("spec, match", [
    (dict(method="eagle", num_speculative_tokens=2), "method"),
    (dict(method="ngram"), "num_speculative_tokens"),
    (dict(method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min"),
    (dict(method="ngram", num_speculative_tokens=2, model="x"), "unknown key"),
    (dict(method="early_exit", num_speculative_tokens=2, model="x"), "unknown key"),
    (dict(method="draft_model", num_speculative_tokens=2, model="x"), "separate, smaller checkpoint"),
    (dict(num_speculative_tokens=2), "method"),
])
def test_a_bad_speculative_config_is_refused_by_name(spec, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=spec)


def test_unsupported_combinations_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(speculative_config=NGRAM, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="num_draft_layers"):
        LLM(MODEL, **CPU, num_kvcache_blocks=16, speculative_config=dict(DRAFT, num_draft_layers=4))
    assert SpeculativeConfig.from_dict(dict(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3)) \
        .prompt_lookup_min == 3     # vLLM's rule: one bound given sets the other
    llm = LLM(MODEL, **CPU, num_kvcache_blocks=32, speculative_config=DRAFT)
    with pytest.raises(ValueError, match="beam_search"):
        llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=3))
    assert not llm.has_unfinished_requests()
    check_invariants(llm.block_manager, [])


# ---------------------------------------------------------------- faults roll back


FAULT_CONFIGS = {
    "ngram-recompute": (NGRAM, dict(block_size=4, num_kvcache_blocks=18)),
    "draft-swap-mixed": (DRAFT, dict(block_size=4, num_kvcache_blocks=18, preemption_mode="swap", num_cpu_blocks=24,
                                     scheduling="mixed", max_num_batched_tokens=16, same_step_prefix_hits=True)),
}
FAULT_PARAMS = [SamplingParams(max_tokens=10, **GREEDY),
                SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True, seed=3),
                SamplingParams(max_tokens=11, **GREEDY),
                SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=4)]
# The draft, the verification, the rollback and the metrics: (what holds it, its name).
FAULT_POINTS = [("scheduler", n) for n in ("_schedule_lookahead", "_record_speculative", "_count_draft",
                                           "_check_drafts")] + \
               [("block_manager", n) for n in ("allocate_lookahead_slots", "free_lookahead_slots", "_release_to_head",
                                               "_allocate_block")] + \
               [("model_runner", n) for n in ("execute_speculative", "propose", "_propose_early_exit",
                                              "_forward")] + \
               [("sampler", n) for n in ("probs", "generator_for")] + \
               [("proposer", "propose"), ("spec_decode", "greedy_accept"), ("spec_decode", "rejection_sample")]


def fault_holder(llm, where):
    return {"scheduler": llm.scheduler, "block_manager": llm.block_manager, "model_runner": llm.model_runner,
            "sampler": llm.model_runner.sampler, "proposer": llm.model_runner.proposer,
            "spec_decode": spec_decode}[where]


def spec_snapshot(llm):
    snap = snapshot(llm)
    snap["spec stats"] = astuple(llm.scheduler.spec_decoding_stats)
    return snap


def run_with_faults(llm, prompts, checks):
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, FAULT_PARAMS)]
    outputs = {}
    real_execute = llm.model_runner.execute_model
    kv_written = []

    def execute(*args, **kwargs):
        kv_written.append(True)
        return real_execute(*args, **kwargs)

    llm.model_runner.execute_model = execute
    try:
        for _ in range(200):
            if not llm.has_unfinished_requests():
                break
            before = spec_snapshot(llm)
            kv_written.clear()
            try:
                finished = llm.step()
            except (RuntimeError, KeyboardInterrupt) as e:
                if "injected fault" not in str(e):
                    raise
                checks.append(compare(llm, before, spec_snapshot(llm), bool(kv_written)))
                continue
            for out in finished:
                outputs[out.request_id] = out.token_ids
    finally:
        del llm.model_runner.execute_model
    return [outputs[i] for i in ids]


@pytest.mark.parametrize("config", list(FAULT_CONFIGS))
def test_a_fault_in_the_draft_the_verification_or_the_rollback_undoes_the_step(config):
    spec, engine = FAULT_CONFIGS[config]
    prompts = [text_prompts()[i] for i in (1, 2, 3, 0)]   # the sampled ones repeat: their drafts are verified
    expected = run_with_faults(LLM(MODEL, **CPU, **engine, speculative_config=spec), prompts, [])
    llm = LLM(MODEL, **CPU, **engine, speculative_config=spec)
    fired = set()
    for where, name in FAULT_POINTS:
        obj = fault_holder(llm, where)
        if not hasattr(obj, name):
            continue
        for at, exc in [(2, RuntimeError), (5, KeyboardInterrupt)]:
            real = getattr(obj, name)
            fault = Fault(real, exc, at)
            setattr(obj, name, fault)
            checks = []
            try:
                got = run_with_faults(llm, prompts, checks)
            finally:
                if where == "spec_decode":
                    setattr(obj, name, real)
                else:
                    delattr(obj, name)
            assert got == expected, f"{where}.{name} failing at call {at}: other tokens than a fault-free run"
            assert fault.fired == bool(checks)
            if fault.fired:
                fired.add((where, name))
            check_invariants(llm.block_manager, [])
    must = {("scheduler", "_schedule_lookahead"), ("scheduler", "_record_speculative"),
            ("block_manager", "allocate_lookahead_slots"), ("block_manager", "free_lookahead_slots"),
            ("block_manager", "_release_to_head"), ("model_runner", "execute_speculative"),
            ("model_runner", "propose"), ("spec_decode", "greedy_accept"), ("spec_decode", "rejection_sample")}
    must |= {("proposer", "propose")} if spec is NGRAM else {("model_runner", "_propose_early_exit")}
    assert must <= fired, f"never hit: {sorted(must - fired)}"


def test_forks_speculate_each_and_greedy_logprobs_are_the_targets():
    """n completions fork after the first token and then speculate one by one; greedy cumulative
    log-probabilities equal those of the engine without speculation."""
    prompts = text_prompts()[:3]
    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=128, speculative_config=DRAFT)
    outs = llm.generate(prompts, SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [12] * 9
    assert llm.get_metrics().spec_decode_num_drafts > 9
    check_invariants(llm.block_manager, [])
    sp = SamplingParams(max_tokens=14, **GREEDY)
    plain = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=128).generate(prompts, sp, use_tqdm=False)
    spec = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=128, speculative_config=DRAFT).generate(
        prompts, sp, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob, abs=1e-4)
