"""The Scheduler's two policies, each a small object (chapters 06 and 09).

* An **admission policy** decides which prompts and decodes share a step. ``PrefillFirst``
  (chapter 06, Nano-vLLM's) runs a step of prompts whenever a waiting prompt can be admitted,
  else a step of decodes. ``Mixed`` (chapter 09; Sarathi-Serve's *stall-free batching*, the
  shape of vLLM v1's token-budget scheduler) gives every running sequence its decode token
  first and fills the rest of the token budget with prompt chunks.
* A **preemption policy** decides what a preempted sequence keeps. ``Recompute`` (vLLM v1's
  only mode) frees its blocks: it is computed again on readmission. ``Swap`` (vLLM v0's
  ``preemption_mode="swap"``) copies its K/V to a CPU block pool and back, falling back to
  recompute when the pool is full.

Both do their work through the Scheduler's routines (``_schedule_prompts``,
``_schedule_decodes``, ``preempt``); a policy keeps no state of its own besides the CPU pool.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from course_pkg.sequence import SequenceStatus
from course_pkg.swap import CpuBlockPool
from course_pkg.validation import check_int

if TYPE_CHECKING:   # the scheduler imports this module
    from course_pkg.scheduler import Scheduler, StepPlan
    from course_pkg.sequence import Sequence


# ---------------------------------------------------------------- admission


class AdmissionPolicy:
    """Fills one step's ``plan`` through ``sched._schedule_prompts`` and ``sched._schedule_decodes``."""

    name = "?"

    def schedule(self, sched: Scheduler, plan: StepPlan) -> None:
        raise NotImplementedError


class PrefillFirst(AdmissionPolicy):
    """A step of prompts whenever one can be admitted, else a step of decodes (Nano-vLLM).

    New requests join as soon as blocks allow -- *continuous batching* -- but a long prompt
    stalls every running sequence for the steps it takes.
    """

    name = "prefill_first"

    def schedule(self, sched: Scheduler, plan: StepPlan) -> None:
        if sched._schedule_prompts(plan, sched.max_num_batched_tokens):
            return
        if sched._schedule_decodes(plan) or not sched.waiting:
            return
        # The decodes preempted every running sequence, the last one by releasing its own
        # blocks. (check() makes that impossible for this policy -- the oldest runner always
        # fits once the others are gone -- but another block manager may do it.) The pool is
        # free again, so admission goes ahead in this same step.
        sched._schedule_prompts(plan, sched.max_num_batched_tokens)


class Mixed(AdmissionPolicy):
    """Decodes first, then prompt chunks in what is left of the token budget.

    Every running sequence gets its next token in every step, so no prefill stalls it; the
    waiting prompts share the rest of ``max_num_batched_tokens``, chunked where they do not
    fit. (Sarathi-Serve's stall-free batching; vLLM v1 has no phases at all and walks its
    running requests, partly prefilled ones included, before its waiting ones.)
    """

    name = "mixed"

    def schedule(self, sched: Scheduler, plan: StepPlan) -> None:
        num_decodes = sched._schedule_decodes(plan)
        sched._schedule_prompts(plan, sched.max_num_batched_tokens - num_decodes)


ADMISSION_POLICIES = {"prefill_first": PrefillFirst, "mixed": Mixed}


def make_admission_policy(scheduling) -> AdmissionPolicy:
    """``scheduling`` by name ("prefill_first", "mixed"), or an ``AdmissionPolicy`` as it is."""
    if isinstance(scheduling, AdmissionPolicy):
        return scheduling
    if not isinstance(scheduling, str) or scheduling not in ADMISSION_POLICIES:
        raise ValueError(f"scheduling must be one of {tuple(ADMISSION_POLICIES)} or an AdmissionPolicy, "
                         f"got {scheduling!r}")
    return ADMISSION_POLICIES[scheduling]()


# ---------------------------------------------------------------- preemption


class PreemptionPolicy:
    """What a preempted sequence gives up, and how it comes back."""

    name = "?"

    def make_cpu_pool(self) -> CpuBlockPool | None:
        return None

    def preempt(self, sched: Scheduler, seq: Sequence, plan: StepPlan) -> SequenceStatus:
        """Free ``seq``'s device blocks; return its new status (PREEMPTED or SWAPPED)."""
        raise NotImplementedError

    def swap_in(self, sched: Scheduler, seq: Sequence, plan: StepPlan) -> bool:
        raise RuntimeError(f"sequence {seq.seq_id} is SWAPPED, but preemption_mode={self.name!r} never swaps")

    def release(self, sched: Scheduler, seq: Sequence) -> None:
        """``seq`` is aborted: drop whatever the policy keeps for it."""

    def step_done(self, sched: Scheduler, out) -> None:
        """The step ``out`` ran: its copies are made."""


class Recompute(PreemptionPolicy):
    """The victim frees its blocks and is computed again (prompt and generated tokens) on
    readmission; its blocks stay cached, so a readmission soon after often hits most of them."""

    name = "recompute"

    def preempt(self, sched, seq, plan):
        sched.block_manager.deallocate(seq)
        return SequenceStatus.PREEMPTED


class Swap(PreemptionPolicy):
    """The victim's computed blocks are copied to a CPU pool and back on readmission, instead
    of being recomputed; when the CPU pool has no room it is recomputed (counted as a fallback).

    The copies are listed in the step's ``blocks_to_swap_out`` / ``blocks_to_swap_in`` as
    ``(src, dst)`` pairs, for whoever owns the KV tensors. A swapped-in sequence's CPU blocks
    are released once the step that copied them back has run.
    """

    name = "swap"

    def __init__(self, num_cpu_blocks: int):
        check_int("num_cpu_blocks", num_cpu_blocks, minimum=1)
        self.num_cpu_blocks = num_cpu_blocks

    def make_cpu_pool(self) -> CpuBlockPool:
        return CpuBlockPool(self.num_cpu_blocks)

    def preempt(self, sched, seq, plan):
        pool, bm = sched.cpu_pool, sched.block_manager
        num_blocks = -(-seq.num_cached_tokens // sched.block_size)   # the blocks holding computed K/V
        if not pool.can_swap_out(num_blocks):
            sched.stats.num_swap_fallbacks += 1
            bm.deallocate(seq)
            return SequenceStatus.PREEMPTED
        device_blocks, num_computed = seq.block_table[:num_blocks], seq.num_cached_tokens
        bm.deallocate(seq)
        cpu_blocks = pool.swap_out(seq.seq_id, num_blocks, num_computed)
        # Safe although the freed blocks may be handed out again in this same step: the copies
        # run before the forward pass that writes them.
        plan.blocks_to_swap_out += zip(device_blocks, cpu_blocks)
        sched.stats.num_swapped_out += 1
        return SequenceStatus.SWAPPED

    def swap_in(self, sched, seq, plan):
        pool, bm = sched.cpu_pool, sched.block_manager
        if not bm.can_swap_in(seq):
            return False
        bm.allocate_for_swap_in(seq)
        plan.blocks_to_swap_in += zip(pool.block_table(seq.seq_id), seq.block_table)
        seq.num_cached_tokens = pool.num_computed_tokens(seq.seq_id)
        sched.stats.num_swapped_in += 1
        return True

    def release(self, sched, seq):
        if seq.seq_id in sched.cpu_pool:
            sched.cpu_pool.release(seq.seq_id)

    def step_done(self, sched, out):
        # A sequence scheduled in the step it was swapped in read its CPU blocks: they are free now.
        for seq in out.seqs:
            if seq.seq_id in sched.cpu_pool:
                sched.cpu_pool.release(seq.seq_id)


PREEMPTION_POLICIES = {"recompute": Recompute, "swap": Swap}


def make_preemption_policy(preemption_mode, num_cpu_blocks: int | None = None) -> PreemptionPolicy:
    """``preemption_mode`` by name ("recompute", or "swap" with ``num_cpu_blocks``), or a
    ``PreemptionPolicy`` as it is."""
    if isinstance(preemption_mode, PreemptionPolicy):
        return preemption_mode
    if not isinstance(preemption_mode, str) or preemption_mode not in PREEMPTION_POLICIES:
        raise ValueError(f"preemption_mode must be one of {tuple(PREEMPTION_POLICIES)} or a PreemptionPolicy, "
                         f"got {preemption_mode!r}")
    if num_cpu_blocks is not None:
        check_int("num_cpu_blocks", num_cpu_blocks, minimum=0)
    if preemption_mode == "swap":
        if not num_cpu_blocks:
            raise ValueError(f"preemption_mode='swap' needs a CPU block pool to swap to, but num_cpu_blocks="
                             f"{num_cpu_blocks!r}; pass num_cpu_blocks >= 1, or use preemption_mode='recompute'")
        return Swap(num_cpu_blocks)
    if num_cpu_blocks:
        raise ValueError(f"num_cpu_blocks={num_cpu_blocks!r} sizes the CPU pool of preemption_mode='swap'; "
                         "with preemption_mode='recompute' nothing is swapped (leave it None)")
    return Recompute()
