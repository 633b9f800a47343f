"""Chapter 09 grader: the CPU block pool that preemption by swapping allocates from."""
from __future__ import annotations

import random

from course_pkg.labs.lab import Grading
from course_pkg.swap import CpuBlockPool


def _state(pool) -> tuple:
    return (list(pool.free_block_ids), {k: (list(v[0]), v[1]) for k, v in pool.swapped.items()})


def grade_cpu_pool(impl, g: Grading) -> None:
    with g.scenario("swap out and release by hand (4 CPU blocks)"):
        pool = impl(4)
        g.equal(pool.swap_out(7, 2, 5), [0, 1], "swap_out(seq 7, 2 blocks) takes the two blocks at the head")
        g.equal(pool.swap_out(8, 1, 3), [2], "swap_out(seq 8, 1 block)")
        g.equal((pool.block_table(7), pool.num_computed_tokens(7)), ([0, 1], 5), "seq 7's CPU blocks and tokens")
        g.check(7 in pool and 8 in pool, "seqs 7 and 8 are swapped out")
        pool.release(7)
        g.check(7 not in pool, "seq 7 is not swapped out after release(7)")
        g.equal(list(pool.free_block_ids), [3, 0, 1], "free queue after release(7): its blocks go to the tail")
        g.equal(pool.swap_out(9, 3, 10), [3, 0, 1], "swap_out(seq 9, 3 blocks) after the release")
        g.equal(pool.num_free_blocks, 0, "free blocks")
    with g.scenario("can_swap_out at the edge"):
        pool = impl(3)
        pool.swap_out(1, 1, 2)
        g.equal((pool.can_swap_out(2), pool.can_swap_out(3)), (True, False), "can_swap_out(2), can_swap_out(3) with 2 free")
    with g.scenario("a refused swap-out changes nothing"):
        pool = impl(3)
        pool.swap_out(1, 2, 6)
        before = _state(pool)
        for seq_id, num_blocks, why in ((2, 2, "2 blocks, 1 free"), (1, 1, "seq 1 is swapped out already")):
            try:
                pool.swap_out(seq_id, num_blocks, 4)
            except ValueError:
                pass
            else:
                g.fail(f"swap_out({seq_id}, {num_blocks}) should raise ValueError: {why}")
            g.equal(_state(pool), before, f"(free queue, swapped) after the refused swap_out ({why})")
    with g.scenario("3000 random swap-outs and releases, in lockstep with the package's pool"):
        rng = random.Random(9)
        mine, ref = impl(16), CpuBlockPool(16)
        for step in range(3000):
            if ref.swapped and rng.random() < 0.45:
                seq_id = rng.choice(sorted(ref.swapped))
                mine.release(seq_id)
                ref.release(seq_id)
            else:
                seq_id, n = rng.randrange(40), rng.randint(1, 5)
                if seq_id in ref or not ref.can_swap_out(n):
                    continue
                g.equal(mine.swap_out(seq_id, n, 4 * n), ref.swap_out(seq_id, n, 4 * n), f"step {step}: swap_out ids")
            g.equal(_state(mine), _state(ref), f"step {step}: (free queue, swapped)")
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
