"""``cache_salt`` (chapter 12): requests share cached blocks only with requests of the same salt.

vLLM's fix for the prefix-cache timing side channel (GHSA-4qjh-9fv9-r85r) mixes a per-request
salt into the hash of the first block only. Checked here: different salts share no block and
report no cached tokens; the same salt shares every full block; a salt changes the first
block's hash and, through the chain, every later one, and nothing else; a model of which
requests may share predicts every hit count exactly; greedy tokens with salts equal Hugging
Face's; forks and beams inherit the salt; a bad salt raises with nothing queued.
"""
from __future__ import annotations

import random

import pytest
import torch
import xxhash
from hypothesis import given, settings, strategies as st

from course_pkg import LLM, BlockManager, SamplingParams, Sequence, compute_hash
from course_pkg.block_manager import salt_hash
from course_pkg.models import default_model_path
from course_pkg.sampling_params import BeamSearchParams
from tests.helpers import admit, check_invariants
from tests.test_engine import hf_greedy

MODEL = default_model_path()
CPU = dict(device="cpu", dtype=torch.float32, attention_backend="torch")
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BS = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """One torch thread for this module (see conftest)."""


def salted(tokens, salt=None, block_size=BS) -> Sequence:
    return Sequence(list(tokens), block_size=block_size, cache_salt=salt)


# ---------------------------------------------------------------- the block manager

def test_different_salts_share_no_block_and_the_same_salt_shares_every_full_block():
    bm = BlockManager(32, BS)
    prompt = list(range(10, 23))                      # 13 tokens: 3 full blocks + 1
    alice = admit(bm, salted(prompt, "alice"))
    bob = admit(bm, salted(prompt, "bob"))
    plain = admit(bm, salted(prompt))
    again = admit(bm, salted(prompt, "alice"))
    assert bob.num_cached_tokens == bob.num_tokens and plain.num_cached_tokens == plain.num_tokens  # computed
    stats = bm.prefix_cache_stats
    assert stats.requests == 4 and stats.hits == 3 * BS     # only the second "alice" hit anything
    for other in (bob, plain):
        assert not set(other.block_table) & set(alice.block_table), "different salts shared a block"
    assert again.block_table[:3] == alice.block_table[:3]   # every full block the lookup may take
    assert again.block_table[3] != alice.block_table[3]     # the last token's block is never a hit
    assert [bm.blocks[b].ref_count for b in alice.block_table] == [2, 2, 2, 1]
    check_invariants(bm, [alice, bob, plain, again])


def test_a_salt_changes_the_first_hash_and_through_the_chain_every_later_one_and_nothing_else():
    """Two managers driven by one trace, one salting every request: same tables, ref counts,
    tokens and free queue; the hashes differ at every block, and each later block is chained
    on its salted parent exactly as an unsalted one is chained on its parent."""
    prompts = [list(range(1, 18)), list(range(1, 10)) + [99] * 5, list(range(1, 18))]
    managers = {salt: BlockManager(24, BS) for salt in (None, "org-7")}
    seqs = {salt: [admit(bm, salted(p, salt)) for p in prompts] for salt, bm in managers.items()}
    plain, salty = managers[None], managers["org-7"]
    assert [s.block_table for s in seqs[None]] == [s.block_table for s in seqs["org-7"]]
    assert [(b.ref_count, b.token_ids) for b in plain.blocks] == [(b.ref_count, b.token_ids) for b in salty.blocks]
    assert list(plain.free_block_ids) == list(salty.free_block_ids)
    assert seqs["org-7"][2].num_cached_tokens == seqs[None][2].num_cached_tokens
    for p, s in zip(seqs[None], seqs["org-7"]):
        assert len(p.block_hashes) == len(s.block_hashes) > 1
        assert all(a != b for a, b in zip(p.block_hashes, s.block_hashes)), "a salted hash equals an unsalted one"
        # The salt enters the first block only: the first hash is the tokens chained on a hash
        # of the salt (computed here with xxhash directly), the rest the ordinary chain.
        root = xxhash.xxh64(b"cache_salt:org-7").intdigest()
        assert s.block_hashes[0] == compute_hash(s.block(0), root)
        for i in range(1, len(s.block_hashes)):
            assert s.block_hashes[i] == compute_hash(s.block(i), s.block_hashes[i - 1])
            assert p.block_hashes[i] == compute_hash(p.block(i), p.block_hashes[i - 1])
    assert salt_hash(None) == -1 and salt_hash("a") != salt_hash("b")
    assert {b.cache_salt for b in salty.blocks if b.hash != -1} == {"org-7", None}   # first blocks only


def test_a_salt_never_hits_on_an_unsalted_block_even_when_the_hash_collides(monkeypatch):
    """The hash made blind to the chain (tokens only), so a salted first block finds the
    unsalted block of the same tokens: the exact check (tokens, parent prefix, salt) decides."""
    bm = BlockManager(16, BS)
    monkeypatch.setattr(bm, "compute_hash", lambda token_ids, prefix=-1: hash(tuple(token_ids)))
    first = admit(bm, salted(range(1, 10)))
    assert bm.hash_to_block_id[hash((1, 2, 3, 4))] == first.block_table[0]   # what eve's lookup finds
    assert bm.can_allocate(salted(range(1, 10))) == 2        # unsalted: both full blocks hit
    assert bm.can_allocate(salted(range(1, 10), "eve")) == 0
    eve = admit(bm, salted(range(1, 10), "eve"))
    assert not set(eve.block_table) & set(first.block_table) and bm.prefix_cache_stats.hits == 0
    check_invariants(bm, [first, eve])


def test_a_later_block_of_another_salt_is_never_a_hit_even_when_the_hash_collides(monkeypatch):
    """Block 0 hits under the request's own salt; block 1's hash finds a block of another salt
    with the same tokens after the same first-block tokens. Only the exact prefix id -- whose
    key holds the first block's salt -- tells the two chains apart."""
    bm = BlockManager(24, BS)
    monkeypatch.setattr(bm, "compute_hash", lambda token_ids, prefix=-1: hash(tuple(token_ids)))
    b0, b1 = [1, 2, 3, 4], [5, 6, 7, 8]
    a = admit(bm, salted(b0 + b1 + [9], "A"))
    own = admit(bm, salted(b0 + [20], "B"))                 # B's own first block, now in the index
    assert bm.hash_to_block_id[hash(tuple(b1))] == a.block_table[1]
    probe = admit(bm, salted(b0 + b1 + [30], "B"))
    assert probe.block_table[0] == own.block_table[0]       # its own salt's block 0: a hit
    assert probe.block_table[1] != a.block_table[1]         # A's block 1: never
    assert probe.block_table[1] not in a.block_table
    check_invariants(bm, [a, own, probe])


@settings(max_examples=150, deadline=None)
@given(requests=st.lists(st.tuples(st.lists(st.integers(1, 2), min_size=1, max_size=13),
                                   st.sampled_from([None, "a", "b"])), min_size=1, max_size=8))
def test_hits_are_exactly_the_full_blocks_shared_with_an_earlier_request_of_the_same_salt(requests):
    """A model of the rule, independent of the hashing: with a pool too large to evict, a
    request hits the longest run of leading full blocks (not the one holding its last token)
    that some earlier request of the same salt computed."""
    bm = BlockManager(8 * 4 + 1, BS)
    done: list[tuple[list[int], str | None]] = []
    live = []
    for tokens, salt in requests:
        limit = (len(tokens) - 1) // BS
        expected = 0
        for earlier, earlier_salt in done:
            if earlier_salt != salt:
                continue
            k = 0
            while k < limit and k < len(earlier) // BS and earlier[:(k + 1) * BS] == tokens[:(k + 1) * BS]:
                k += 1
            expected = max(expected, k)
        seq = salted(tokens, salt)
        assert bm.can_allocate(seq) == expected
        live.append(admit(bm, seq))
        done.append((tokens, salt))
    check_invariants(bm, live)


def test_a_fork_inherits_the_salt():
    parent = salted(range(9), "alice")
    assert parent.fork(1).cache_salt == "alice"


@pytest.mark.parametrize("salt", ["", 7, b"alice", ["a"], "\ud800"])
def test_a_bad_salt_is_refused_by_the_sequence(salt):
    with pytest.raises((ValueError, TypeError), match="cache_salt"):
        salted(range(5), salt)


# ---------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, block_size=BS, num_kvcache_blocks=64, **CPU)


def test_engine_reports_no_cached_tokens_across_salts_and_every_full_block_within_one(llm, hf_model):
    system = list(range(40, 57))                        # 17 tokens: 4 full blocks
    prompts = [system + [200 + i, 300 + i, 400 + i] for i in range(3)]
    cases = [({"prompt_token_ids": prompts[0], "cache_salt": "alice"}, 0),
             ({"prompt_token_ids": prompts[1], "cache_salt": "bob"}, 0),      # other salt: no hit
             ({"prompt_token_ids": prompts[2]}, 0),                           # no salt: no hit
             ({"prompt_token_ids": prompts[1], "cache_salt": "alice"}, 16),   # same salt: 4 blocks
             ({"prompt_token_ids": prompts[0], "cache_salt": "bob"}, 16),
             (prompts[1], 16)]                                               # unsalted, as before
    for prompt, cached in cases:
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert out.num_cached_tokens == cached, prompt
        assert out.token_ids == hf_greedy(hf_model, out.prompt_token_ids, GREEDY.max_tokens)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_text_prompts_take_a_salt_and_keep_their_text(llm):
    out = llm.generate({"prompt": "Hello there, how are", "cache_salt": "u1"}, GREEDY, use_tqdm=False)
    plain = llm.generate("Hello there, how are", GREEDY, use_tqdm=False)
    assert len(out) == 1 and out[0].prompt == "Hello there, how are"
    assert out[0].token_ids == plain[0].token_ids


def test_parallel_samples_share_the_salted_prompt_blocks(llm):
    prompt = list(range(60, 73))
    params = SamplingParams(temperature=1.0, n=3, max_tokens=3, seed=5, ignore_eos=True)
    rid = llm.add_request({"prompt_token_ids": prompt, "cache_salt": "s"}, params)
    seen = []
    while llm.has_unfinished_requests():
        for seq in llm._completions(rid):
            if seq.block_table:
                seen.append((seq.cache_salt, seq.block_table[0]))
        llm.step()
    assert {s for s, _ in seen} == {"s"} and len({b for _, b in seen}) == 1   # one shared first block
    again = llm.generate({"prompt_token_ids": prompt, "cache_salt": "s"}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 12


def test_beam_search_with_a_salt_finds_the_same_beams_and_hits_only_its_salt(llm):
    prompt = list(range(80, 94))
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    plain = llm.beam_search([prompt], params)[0]
    stats = llm.block_manager.prefix_cache_stats
    hits = stats.hits
    salty = llm.beam_search([{"prompt_token_ids": prompt, "cache_salt": "x"}], params)[0]
    assert [s.tokens for s in salty.sequences] == [s.tokens for s in plain.sequences]
    assert stats.hits == hits                             # the unsalted beams' blocks are not its own
    llm.beam_search([{"prompt_token_ids": prompt, "cache_salt": "x"}], params)
    assert stats.hits == hits + 12
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


BAD = [({"prompt_token_ids": [5, 6], "cache_salt": ""}, ValueError, "non-empty"),
       ({"prompt_token_ids": [5, 6], "cache_salt": 3}, TypeError, "cache_salt"),
       ({"prompt_token_ids": [5, 6], "cache_salt": "a\ud800"}, ValueError, "valid Unicode"),  # would fail in salt_hash
       ({"prompt_token_ids": [5, 6], "cache_salt": None}, None, None),          # None: no salt
       ({"prompt": "hi", "prompt_token_ids": [5]}, ValueError, "exactly one"),
       ({"cache_salt": "a"}, ValueError, "exactly one"),
       ({"prompt_token_ids": [5, 6], "salt": "a"}, ValueError, "unknown prompt field"),
       ({"prompt": [5, 6]}, TypeError, "prompt_token_ids"),
       ({"prompt_token_ids": "5 6"}, TypeError, "list of ints")]


@pytest.mark.parametrize("prompt,error,match", BAD)
@pytest.mark.parametrize("entry", ["generate", "add_request", "beam_search"])
def test_a_bad_prompt_dict_raises_and_queues_nothing(llm, prompt, error, match, entry):
    bm = llm.block_manager
    before = (bm.num_free_blocks, len(llm.scheduler.waiting), len(llm.scheduler.running),
              bm.prefix_cache_stats.requests)
    call = {"generate": lambda: llm.generate([[7, 8, 9], prompt], GREEDY, use_tqdm=False),
            "add_request": lambda: llm.add_request(prompt, GREEDY),
            "beam_search": lambda: llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=2))}[entry]
    if error is None:
        call()
        while llm.has_unfinished_requests():
            llm.step()
        return
    with pytest.raises(error, match=match):
        call()
    assert not llm.has_unfinished_requests()
    assert (bm.num_free_blocks, len(llm.scheduler.waiting), len(llm.scheduler.running),
            bm.prefix_cache_stats.requests) == before


ENGINES = {
    "preemption-recompute": dict(block_size=4, num_kvcache_blocks=14, max_num_seqs=6),
    "preemption-swap": dict(block_size=4, num_kvcache_blocks=14, max_num_seqs=6, preemption_mode="swap",
                            num_cpu_blocks=64),
    "mixed-chunked-same-step-hits": dict(block_size=4, num_kvcache_blocks=64, scheduling="mixed",
                                         max_num_batched_tokens=12, same_step_prefix_hits=True),
}


@pytest.mark.parametrize("name", list(ENGINES))
def test_salts_hold_through_preemption_swap_chunking_and_same_step_hits(name):
    """Prompts that share a 12-token prefix, served together under each scheduler path that
    looks the prefix cache up (readmission after preemption, swap-in, prompt chunks, same-step
    hits): the tokens are the unsalted engine's, and a request whose salt nobody else has finds
    nothing cached."""
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(12)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(3 + i % 4)] for i in range(8)]
    salts = ["team", "team", "solo-1", None, "team", "solo-2", None, "team"]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    plain = LLM(MODEL, **CPU, **ENGINES[name]).generate(prompts, params, use_tqdm=False)
    llm = LLM(MODEL, **CPU, **ENGINES[name])
    salted = llm.generate([{"prompt_token_ids": p, "cache_salt": s} if s else p for p, s in zip(prompts, salts)],
                          params, use_tqdm=False)
    assert [o.token_ids for o in salted] == [o.token_ids for o in plain]
    for out, salt in zip(salted, salts):
        if salt is not None and salt.startswith("solo"):
            assert out.num_cached_tokens == 0, salt
    # and the salt is not simply ignored: requests of one salt do share
    assert any(o.num_cached_tokens > 0 for o, s in zip(salted, salts) if s == "team")
    m = llm.get_metrics()
    assert m.num_requests_running == m.num_requests_waiting == 0
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    if "preemption" in name:
        assert any(o.metrics.num_preemptions > 0 for o, s in zip(salted, salts) if s is not None)
