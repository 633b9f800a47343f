"""The side-channel harness of chapter 12: its statistics, the deterministic part of the attack
(what the server reports as ``num_cached_tokens``), and the price of the fix.

The timing part of the attack is measured in ``benchmarks/prefix_timing_attack.py``, never
asserted here: TTFT on a shared machine is noise plus signal, and a test must not flake.
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, strategies as st

from course_pkg import LLM
from course_pkg.workloads.side_channel import (SCENARIOS, accuracy, roc_auc, run_attack, secret_blocks,
                                               shared_prompt_hit_rates, wilson_interval)

scores = st.lists(st.integers(-5, 5).map(float), min_size=1, max_size=20)


@given(positives=scores, negatives=scores)
def test_roc_auc_is_the_pairwise_win_rate(positives, negatives):
    """By definition: over every (positive, negative) pair, 1 for a win, 1/2 for a tie."""
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in positives for n in negatives)
    assert roc_auc(positives, negatives) == pytest.approx(wins / (len(positives) * len(negatives)))


def test_wilson_interval_matches_published_values():
    """Wilson (1927) without continuity correction, as R's binom.confint(method="wilson") gives it."""
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(25, 200)[0] < 0.125 < wilson_interval(25, 200)[1]
    for n in range(1, 200):        # the bounds at 0 and n successes are 0 and 1, never printed "-0.00"
        assert wilson_interval(0, n)[0] == 0.0 and wilson_interval(n, n)[1] == 1.0
    with pytest.raises(ValueError):
        wilson_interval(1, 0)


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return LLM(None, block_size=8, num_kvcache_blocks=1024, device="cpu", dtype=torch.float32,
               attention_backend="torch")


def test_secret_blocks_are_full_and_distinct(llm):
    blocks = secret_blocks(llm.tokenizer, 8)
    assert all(len(b) == 8 for b in blocks) and len({tuple(b) for b in blocks}) == len(blocks)
    with pytest.raises(ValueError, match="same first"):
        secret_blocks(llm.tokenizer, 8, names=("Alice", "Alice"))
    with pytest.raises(ValueError, match="fewer than a block"):
        secret_blocks(llm.tokenizer, 8, template="{name}")


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_what_the_server_reports_gives_the_secret_away_exactly_when_the_salts_match(llm, scenario):
    victim, attacker = SCENARIOS[scenario]
    trials = run_attack(llm, secret_blocks(llm.tokenizer, 8)[:4], 6, victim, attacker, system_blocks=2,
                        seed=list(SCENARIOS).index(scenario))
    for t in trials:
        cached = {p.candidate: p.num_cached_tokens for p in t.probes}
        if victim == attacker:
            # the system prompt's 2 blocks for everyone, one more block for the secret's probe
            assert cached[t.secret] == 24 and all(v == 16 for c, v in cached.items() if c != t.secret)
        else:
            # the attacker hits only its own system prompt, after its first probe: nothing to learn
            first = min(t.probes, key=lambda p: p.order)
            assert first.num_cached_tokens == 0
            assert all(p.num_cached_tokens == 16 for p in t.probes if p is not first)
    if victim == attacker:
        assert accuracy(trials, "cached_tokens") == 1.0
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_the_partial_block_secret_is_never_hit(llm):
    trials = run_attack(llm, secret_blocks(llm.tokenizer, 8)[:4], 4, system_blocks=2, secret_at_end=True, seed=99)
    assert all(p.num_cached_tokens == 16 for t in trials for p in t.probes)


def test_the_price_of_the_fix_is_the_hits_shared_across_the_salts():
    """Against a model of the rule: each request hits the longest run of leading full blocks it
    shares with an earlier request of the same salt (not the block of its last token)."""
    kw = dict(num_orgs=2, users_per_org=2, requests_per_user=3, system_tokens=40, org_tokens=24,
              user_tokens=16, question_tokens=8, block_size=8, seed=3)
    got = shared_prompt_hit_rates(**kw)
    # the same workload, rebuilt with the same draws
    rng = random.Random(3)

    def tokens(n):
        return [rng.randrange(3, 1000) for _ in range(n)]

    system = tokens(40)
    org_text = [tokens(24) for _ in range(2)]
    user_text = {(o, u): tokens(16) for o in range(2) for u in range(2)}
    requests = [(o, u, system + org_text[o] + user_text[o, u] + tokens(8))
                for _ in range(3) for o in range(2) for u in range(2)]
    rng.shuffle(requests)
    salts = {"no salts": lambda o, u: 0, "one salt per organisation": lambda o, u: o,
             "one salt per user": lambda o, u: (o, u)}
    for rule, salt_of in salts.items():
        hits, seen = 0, []
        for o, u, t in requests:
            best = 0
            for salt, earlier in seen:
                if salt != salt_of(o, u):
                    continue
                k = 0
                while k < (len(t) - 1) // 8 and earlier[:(k + 1) * 8] == t[:(k + 1) * 8]:
                    k += 1
                best = max(best, k)
            hits += best * 8
            seen.append((salt_of(o, u), t))
        assert got[rule] == pytest.approx(hits / sum(len(r[2]) for r in requests)), rule
    assert got["no salts"] > got["one salt per organisation"] > got["one salt per user"] > 0
