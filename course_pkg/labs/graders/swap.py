"""Chapter 09 grader: the CPU block pool that preemption by swapping allocates from.

Which free CPU block a swap-out gets does not matter: the CPU blocks hold no prefix cache, so
nothing is found by block id later, and the engine copies K/V to whatever ids ``swap_out``
returns. So the pool's free-queue *order* is not checked (releasing to the head, or in
another order, is right); what is checked is what every order must keep: a swap-out takes
exactly as many blocks as asked, all free, none held by another sequence; a release gives
back exactly the sequence's blocks; free and swapped blocks partition the pool.
"""
from __future__ import annotations

import random

from course_pkg.labs.lab import Grading
from course_pkg.swap import CpuBlockPool


def _state(pool) -> tuple:
    """(free blocks, {seq: (blocks held, computed tokens)}): what every release order gives alike."""
    return (len(pool.free_block_ids), {k: (len(v[0]), v[1]) for k, v in sorted(pool.swapped.items())})


def _partition_problem(pool) -> str | None:
    free = list(pool.free_block_ids)
    held = [b for ids, _ in pool.swapped.values() for b in ids]
    if len(set(free)) != len(free):
        return f"a block is free twice: free {free}"
    if len(set(held)) != len(held):
        return f"a block is held by two sequences: {dict(pool.swapped)}"
    if set(free) & set(held):
        return f"blocks {sorted(set(free) & set(held))} are both free and held"
    if set(free) | set(held) != set(range(pool.num_blocks)):
        return f"free {sorted(free)} and held {sorted(held)} do not cover the pool's {pool.num_blocks} blocks"
    if pool.num_free_blocks != len(free):
        return f"num_free_blocks is {pool.num_free_blocks}, the free queue holds {len(free)}"
    return None


def _checked_swap_out(g: Grading, pool, seq_id: int, num_blocks: int, tokens: int, what: str) -> list[int]:
    free_before = set(pool.free_block_ids)
    got = pool.swap_out(seq_id, num_blocks, tokens)
    g.check(isinstance(got, list), f"{what}: swap_out({seq_id}, {num_blocks}) returned {got!r}, not a list of block ids")
    g.check(len(got) == num_blocks and len(set(got)) == num_blocks and set(got) <= free_before,
            f"{what}: swap_out({seq_id}, {num_blocks}) returned {got}: {num_blocks} distinct blocks "
            f"that were free ({sorted(free_before)})")
    g.equal((pool.block_table(seq_id), pool.num_computed_tokens(seq_id)), (list(got), tokens),
            f"{what}: (block_table({seq_id}), num_computed_tokens({seq_id}))")
    problem = _partition_problem(pool)
    g.check(problem is None, f"{what}: after swap_out({seq_id}, {num_blocks}): {problem}")
    return got


def grade_cpu_pool(impl, g: Grading) -> None:
    with g.scenario("swap out and release by hand (4 CPU blocks)"):
        pool = impl(4)
        a = _checked_swap_out(g, pool, 7, 2, 5, "seq 7")
        b = _checked_swap_out(g, pool, 8, 1, 3, "seq 8")
        g.check(7 in pool and 8 in pool and 9 not in pool, "seqs 7 and 8 are swapped out, 9 is not")
        pool.release(7)
        g.check(7 not in pool, "seq 7 is not swapped out after release(7)")
        g.equal(sorted(pool.free_block_ids), sorted(set(range(4)) - set(b)),
                f"free blocks after release(7): seq 7's blocks {a} are free again, seq 8's {b} are not")
        _checked_swap_out(g, pool, 9, 3, 10, "seq 9 takes every free block")
        g.equal(pool.num_free_blocks, 0, "free blocks")
    with g.scenario("can_swap_out at the edge"):
        pool = impl(3)
        pool.swap_out(1, 1, 2)
        g.equal((pool.can_swap_out(2), pool.can_swap_out(3)), (True, False), "can_swap_out(2), can_swap_out(3) with 2 free")
    with g.scenario("a refused swap-out changes nothing"):
        pool = impl(3)
        pool.swap_out(1, 2, 6)
        before = (list(pool.free_block_ids), {k: (list(v[0]), v[1]) for k, v in pool.swapped.items()})
        for seq_id, num_blocks, why in ((2, 2, "2 blocks, 1 free"), (1, 1, "seq 1 is swapped out already")):
            try:
                pool.swap_out(seq_id, num_blocks, 4)
            except ValueError:
                pass
            else:
                g.fail(f"swap_out({seq_id}, {num_blocks}) should raise ValueError: {why}")
            after = (list(pool.free_block_ids), {k: (list(v[0]), v[1]) for k, v in pool.swapped.items()})
            g.equal(after, before, f"(free queue, swapped) after the refused swap_out ({why})")
    with g.scenario("3000 random swap-outs and releases, next to the package's pool (any release order)"):
        rng = random.Random(9)
        mine, ref = impl(16), CpuBlockPool(16)
        for step in range(3000):
            if ref.swapped and rng.random() < 0.45:
                seq_id = rng.choice(sorted(ref.swapped))
                held = set(mine.block_table(seq_id))
                mine.release(seq_id)
                ref.release(seq_id)
                g.check(held <= set(mine.free_block_ids), f"step {step}: release({seq_id}) frees its blocks {sorted(held)}")
            else:
                seq_id, n = rng.randrange(40), rng.randint(1, 5)
                g.equal(mine.can_swap_out(n), ref.can_swap_out(n), f"step {step}: can_swap_out({n})")
                if seq_id in ref or not ref.can_swap_out(n):
                    continue
                ref.swap_out(seq_id, n, 4 * n)
                _checked_swap_out(g, mine, seq_id, n, 4 * n, f"step {step}")
            g.equal(_state(mine), _state(ref), f"step {step}: (free blocks, swapped: blocks held, tokens)")
            problem = _partition_problem(mine)
            g.check(problem is None, f"step {step}: {problem}")
    if not g.passed_so_far:
        g.note("the engine runs with your pool once it passes the scenarios above")
        return
    with g.scenario("the engine swaps with your pool and gives the tokens it gives with the package's"):
        from course_pkg import LLM, SamplingParams

        prompts = [[(7 * i + j) % 900 + 3 for j in range(5 + 2 * i)] for i in range(6)]
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        engine = dict(block_size=4, num_kvcache_blocks=10, max_num_batched_tokens=24, device="cpu",
                      attention_backend="torch", preemption_mode="swap", num_cpu_blocks=32)
        want = [o.token_ids for o in LLM(**engine).generate(prompts, params, use_tqdm=False)]
        llm = LLM(**engine)
        llm.scheduler.cpu_pool = impl(32)
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        g.check(llm.get_metrics().num_swapped_out > 0, "the run should swap (it did not: check can_swap_out)")
        g.equal(got, want, "generated tokens")
        g.equal(llm.scheduler.cpu_pool.num_free_blocks, 32, "free CPU blocks after the run")
