"""What a preemption costs: recomputing a sequence's K/V against swapping them out and back (ch. 09).

Recompute is one prefill forward pass over the sequence's tokens: ``2 x parameters x tokens``
FLOPs plus attention, which grows with the square of the length. Swapping is two copies of
its blocks, ``2 x layers x tokens x kv_heads x head_dim`` values each way, at the speed of the
link between the KV cache and host memory. ``measure_swap_vs_recompute`` times both with the
real ``ModelRunner`` on one checkpoint; the benchmarks and chapter 09 print its rows.
"""
from __future__ import annotations

import time

import torch

from course_pkg.block_manager import BlockManager
from course_pkg.engine.model_runner import ModelRunner
from course_pkg.sequence import Sequence


def _best_time(fn, repeats: int) -> float:
    fn()                                            # warm up: first calls allocate
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_swap_vs_recompute(model_path, lengths: list[int], *, device="cpu", dtype=torch.float32,
                              block_size: int = 16, repeats: int = 3):
    """``(config, rows)``; a row per length: ``(tokens, recompute s, swap-out s, swap-in s, bytes per direction)``.

    Each time is the best of ``repeats`` runs (the least disturbed by other work).
    """
    from course_pkg.models import load_model

    model, config, _ = load_model(model_path, dtype=dtype, device=device)
    num_blocks = max(lengths) // block_size + 1
    cpu = torch.device(device).type == "cpu"
    runner = ModelRunner(model, config, block_size=block_size, num_kvcache_blocks=num_blocks,
                         attention_backend="torch" if cpu else "auto", seed=0, num_cpu_blocks=num_blocks,
                         max_num_batched_tokens=max(lengths))
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    rows = []
    for n in lengths:
        bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        seq = Sequence([(7 * i) % (config.vocab_size - 1) + 1 for i in range(n)], block_size=block_size)
        bm.allocate(seq)
        out_pairs = list(zip(seq.block_table, range(len(seq.block_table))))   # device -> CPU
        in_pairs = [(c, d) for d, c in out_pairs]

        def recompute():
            seq.num_cached_tokens, seq.num_scheduled_tokens = 0, n
            runner.run([seq])
            sync()

        def swap_out():
            runner.swap_out(out_pairs)
            sync()

        def swap_in():
            runner.swap_in(in_pairs)
            sync()

        rows.append((n, _best_time(recompute, repeats), _best_time(swap_out, repeats), _best_time(swap_in, repeats),
                     len(out_pairs) * runner.block_bytes))
    return config, rows


def crossover(rows) -> int | None:
    """The shortest length from which recompute is cheaper than swapping out and in (None: never)."""
    return next((n for n, rec, out, back, _ in rows if rec < out + back), None)
