"""Serve a workload over a student's BlockManager with the package's Scheduler (fake model)."""
from __future__ import annotations

from course_pkg.block_manager import BlockManager
from course_pkg.labs.hooks import keep_private_guards
from course_pkg.scheduler import Scheduler
from course_pkg.workloads import SimResult, WorkloadRun


def serve(bm: BlockManager, requests, *, max_num_seqs: int = 4, max_num_batched_tokens: int = 512,
          max_steps: int = 20_000) -> SimResult:
    """What ``WorkloadRun`` measures, with a step limit: a broken manager must not loop forever.

    ``bm`` is an instance; a student's class is wrapped by ``hooks.keep_private_guards`` first
    (``make_manager`` below).
    """
    scheduler = Scheduler(bm.num_blocks, bm.block_size, block_manager=bm, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens)
    run = WorkloadRun(requests, scheduler)
    for _ in range(max_steps):
        if run.done:
            return run.result()
        run.step()
    raise RuntimeError(f"the workload did not finish in {max_steps} steps")


def make_manager(impl, num_blocks: int, block_size: int, **kwargs) -> BlockManager:
    """An instance of a student's BlockManager class, with the package's private guards kept."""
    return keep_private_guards(impl)(num_blocks, block_size, **kwargs)
