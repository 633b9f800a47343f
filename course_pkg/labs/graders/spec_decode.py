"""Chapter 14 grader: the rollback of a speculative step, ``BlockManager.free_lookahead_slots``.

Each scenario drives the manager under test and the package's in lockstep through speculative
steps as the Scheduler makes them: the newest token's slot (``may_append``), ``k`` lookahead
slots (the package's ``allocate_lookahead_slots``), verification accepting some drafts (their
tokens and one more are appended, ``num_cached_tokens`` grows by the tokens kept), then the
rollback under test, then registration (``hash_blocks``). The state is compared after every
call -- the free queue in order, ref counts, the index, the block tables -- and the ``expect``
lines are computed by hand from the contract: keep exactly the blocks that hold a verified
token, give the others back to the head of the free queue in the order they were taken, register
nothing.
"""
from __future__ import annotations

import random
from functools import lru_cache

from course_pkg.labs.hooks import keep_private_guards
from course_pkg.labs.lab import Grading
from course_pkg.labs.lockstep import Lockstep


ENGINE_PROMPTS = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7, [5, 6, 7, 8] * 3 + [12, 13]]
ENGINE_PARAMS = dict(temperature=0.0, max_tokens=20, ignore_eos=True)


@lru_cache(maxsize=1)
def _without_speculation() -> list[list[int]]:
    """The engine scenario's expected tokens: the same engine without speculation (run once)."""
    from course_pkg import LLM, SamplingParams
    llm = LLM(block_size=4, num_kvcache_blocks=40, device="cpu")
    return [o.token_ids for o in llm.generate(ENGINE_PROMPTS, SamplingParams(**ENGINE_PARAMS), use_tqdm=False)]


def _spec_step(lock: Lockstep, name: str, k: int, accepted: int, tokens) -> None:
    """One speculative step of ``name``: slots for its newest token and ``k`` drafts; verification
    keeps ``accepted`` drafts and one token of the target's; the rollback; registration."""
    lock.call("may_append", name)
    granted = lock.call("allocate_lookahead_slots", name, k, compare_result=True)
    kept = min(accepted, granted) + 1
    for t in list(tokens)[:kept]:
        lock.append_token(name, t)
    for seq in (lock.ref_seqs[name], lock.my_seqs[name]):
        seq.num_cached_tokens += kept          # the old newest token and the accepted drafts
    lock.call("free_lookahead_slots", name, compare_result=True)
    lock.call("hash_blocks", name)


def _admit(lock: Lockstep, name: str, tokens) -> None:
    lock.seq(name, tokens)
    lock.call("allocate", name, lock.call("can_allocate", name))
    lock.computed(name, len(tokens) - 1)      # the prompt's last token is computed with the first decode


def grade_rollback(impl, g: Grading) -> None:
    with g.scenario("one draft of six accepted: the lookahead block goes back to the head (block size 4)"):
        lock = Lockstep(g, impl, 8, 4, free_queue="linked")
        _admit(lock, "A", range(1, 7))                      # 6 tokens: blocks 0, 1; 5 computed
        _spec_step(lock, "A", 6, 1, (50, 51))
        lock.expect("block table of A", (0, 1), "8 tokens, 7 verified: blocks 0 and 1 hold them")
        lock.expect("free queue (head first)", (2, 3, 4, 5, 6, 7), "block 2 held only drafts: back at the head")
        lock.expect("hash index (block ids)", (0,), "7 verified tokens fill one block: only block 0 is "
                    "registered (block 1's last slot holds a rejected draft's K/V)")
    with g.scenario("three drafts of ten accepted: one lookahead block kept, one given back (block size 4)"):
        lock = Lockstep(g, impl, 8, 4, free_queue="linked")
        _admit(lock, "A", range(1, 7))
        _spec_step(lock, "A", 10, 3, (50, 51, 52, 53))      # slots 6 .. 15: blocks 2 and 3 taken
        lock.expect("block table of A", (0, 1, 2), "10 tokens, 9 verified: position 8 is in block 2")
        lock.expect("free queue (head first)", (3, 4, 5, 6, 7), "block 3 held only drafts")
        lock.expect("hash index (block ids)", (0, 1), "9 verified tokens fill two blocks")
    with g.scenario("two drafts of ten accepted: both lookahead blocks back, in the order taken (block size 4)"):
        lock = Lockstep(g, impl, 8, 4, free_queue="linked")
        _admit(lock, "A", range(1, 7))
        _spec_step(lock, "A", 10, 2, (50, 51, 52))
        lock.expect("block table of A", (0, 1), "9 tokens, 8 verified: blocks 0 and 1; the newest token's "
                    "slot is given by the next step's may_append")
        lock.expect("free queue (head first)", (2, 3, 4, 5, 6, 7), "blocks 2 and 3 back at the head, 2 first")
        lock.call("may_append", "A")
        lock.expect("block table of A", (0, 1, 2), "the next step takes block 2 again")
    with g.scenario("every draft accepted: nothing to give back (block size 4)"):
        lock = Lockstep(g, impl, 8, 4, free_queue="linked")
        _admit(lock, "A", range(1, 7))
        _spec_step(lock, "A", 6, 6, range(50, 57))
        lock.expect("block table of A", (0, 1, 2), "13 tokens, 12 verified: 3 full blocks (the newest token's "
                    "slot comes with the next step)")
        lock.expect("hash index (block ids)", (0, 1, 2), "12 verified tokens fill three blocks")
    with g.scenario("block size 1: three lookahead blocks back, in the order taken"):
        lock = Lockstep(g, impl, 12, 1, free_queue="linked")
        _admit(lock, "A", (1, 2, 3))
        _spec_step(lock, "A", 4, 0, (60,))
        lock.expect("block table of A", (0, 1, 2), "4 tokens, 3 verified: one block each")
        lock.expect("free queue (head first)", tuple(range(3, 12)), "blocks 3 .. 6 back at the head, 3 first")
    with g.scenario("a shared prefix and the deque free queue (block size 2)"):
        lock = Lockstep(g, impl, 16, 2)
        _admit(lock, "A", (1, 2, 3, 4, 5))
        lock.call("hash_blocks", "A")
        _spec_step(lock, "A", 3, 1, (7, 8))
        _admit(lock, "B", (1, 2, 3, 4, 9))                  # hits A's first two blocks
        _spec_step(lock, "B", 5, 0, (10,))
        _spec_step(lock, "A", 4, 4, (11, 12, 13, 14, 15))
    for bs, queue in ((1, "linked"), (3, "deque"), (4, "linked")):
        with g.scenario(f"random speculative steps over several sequences (block size {bs}, {queue} queue)"):
            rng = random.Random(14 + bs)
            lock = Lockstep(g, impl, 48, bs, free_queue=queue)
            live = []
            for n in range(60):
                if len(live) < 3 and rng.random() < 0.3 or not live:
                    name = f"S{n}"
                    prompt = [rng.randrange(1, 4) for _ in range(rng.randrange(2, 3 * bs + 2))]
                    lock.seq(name, prompt)
                    hits = lock.call("can_allocate", name)
                    if hits < 0:
                        continue
                    lock.call("allocate", name, hits)
                    lock.computed(name, len(prompt) - 1)
                    live.append(name)
                    continue
                name = rng.choice(live)
                if not lock.call("can_append", name) or rng.random() < 0.1:
                    lock.call("deallocate", name)
                    live.remove(name)
                    continue
                k = rng.randrange(1, 2 * bs + 3)
                _spec_step(lock, name, k, rng.randrange(0, k + 1), [rng.randrange(1, 4) for _ in range(k + 1)])
    with g.scenario("the engine speculating over your manager gives the tokens of an engine that does not"):
        from course_pkg import LLM, SamplingParams
        prompts, sp = ENGINE_PROMPTS, SamplingParams(**ENGINE_PARAMS)
        want = _without_speculation()
        llm = LLM(block_size=4, num_kvcache_blocks=40, device="cpu",
                  speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3,
                                      "prompt_lookup_min": 1})
        llm.scheduler.block_manager = keep_private_guards(impl)(40, 4, True, free_queue="linked")
        got = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        g.equal(got, want, "greedy tokens with speculation")
        bm = llm.scheduler.block_manager
        g.check(len(bm.free_block_ids) == bm.num_blocks, "every block is free once the requests finished")
        g.check(llm.get_metrics().spec_decode_num_accepted_tokens > 0, "some drafts were accepted")
