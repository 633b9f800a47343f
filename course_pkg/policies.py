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

A policy sees only what the Scheduler hands it. An admission policy gets a ``StepBuilder``: the
two ways to fill the step (prompts within a token budget, one decode token per running
sequence) and the step's token budget. A preemption policy gets the victim and the block
manager and answers with what happened (``Preemption``); the Scheduler moves the sequence
between its queues, lists the copies in the step and counts. Neither knows the Scheduler, so
this module imports nothing above the block manager and the CPU pool.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from course_pkg.block_manager import BlockManager
from course_pkg.sequence import Sequence, SequenceStatus
from course_pkg.swap import CpuBlockPool
from course_pkg.validation import check_int


# ---------------------------------------------------------------- admission


@dataclass(frozen=True)
class StepBuilder:
    """What an admission policy may do to the step being built (the Scheduler makes one per step).

    ``schedule_prompts(budget)`` schedules waiting prompts, first come first served, within
    ``budget`` tokens (chunking what does not fit) and returns the tokens scheduled;
    ``schedule_decodes()`` gives every running sequence its next token (preempting where blocks
    run out) and returns how many it scheduled; ``has_waiting()`` says whether a request waits.
    """

    schedule_prompts: Callable[[int], int]
    schedule_decodes: Callable[[], int]
    has_waiting: Callable[[], bool]
    token_budget: int


class AdmissionPolicy:
    """Fills one step through a ``StepBuilder``."""

    name = "?"

    def schedule(self, step: StepBuilder) -> None:
        raise NotImplementedError


class PrefillFirst(AdmissionPolicy):
    """A step of prompts whenever one can be admitted, else a step of decodes (Nano-vLLM).

    New requests join as soon as blocks allow -- *continuous batching* -- but a long prompt
    stalls every running sequence for the steps it takes.
    """

    name = "prefill_first"

    def schedule(self, step: StepBuilder) -> None:
        if step.schedule_prompts(step.token_budget):
            return
        if step.schedule_decodes() or not step.has_waiting():
            return
        # The decodes preempted every running sequence, the last one by releasing its own
        # blocks. (check() makes that impossible for this policy -- the oldest runner always
        # fits once the others are gone -- but another block manager may do it.) The pool is
        # free again, so admission goes ahead in this same step.
        step.schedule_prompts(step.token_budget)


class Mixed(AdmissionPolicy):
    """Decodes first, then prompt chunks in what is left of the token budget.

    Every running sequence gets its next token in every step, so no prefill stalls it; the
    waiting prompts share the rest of ``max_num_batched_tokens``, chunked where they do not
    fit. (Sarathi-Serve's stall-free batching; vLLM v1 has no phases at all and walks its
    running requests, partly prefilled ones included, before its waiting ones.)
    """

    name = "mixed"

    def schedule(self, step: StepBuilder) -> None:
        num_decodes = step.schedule_decodes()
        step.schedule_prompts(step.token_budget - num_decodes)


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


@dataclass
class Preemption:
    """What a preemption policy did with a victim: its new status, the device-to-CPU block
    copies to make (``(device block, CPU block)``), and whether a swap fell back to recompute."""

    status: SequenceStatus
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    fallback: bool = False


class PreemptionPolicy:
    """What a preempted sequence gives up, and how it comes back."""

    name = "?"
    cpu_pool: CpuBlockPool | None = None   # where swapped-out blocks wait (Swap's)

    def preempt(self, seq: Sequence, block_manager: BlockManager) -> Preemption:
        """Free ``seq``'s device blocks."""
        raise NotImplementedError

    def swap_in(self, seq: Sequence, block_manager: BlockManager) -> list[tuple[int, int]] | None:
        """Give a SWAPPED ``seq`` device blocks again: the ``(CPU block, device block)`` copies to
        make, or None if its blocks do not fit now."""
        raise RuntimeError(f"sequence {seq.seq_id} is SWAPPED, but preemption_mode={self.name!r} never swaps")

    def release(self, seq: Sequence) -> None:
        """``seq`` is aborted: drop whatever the policy keeps for it."""

    def step_done(self, seqs) -> None:
        """The step that scheduled ``seqs`` ran: its copies are made."""


class Recompute(PreemptionPolicy):
    """The victim frees its blocks and is computed again (prompt and generated tokens) on
    readmission; its blocks stay cached, so a readmission soon after often hits most of them."""

    name = "recompute"

    def preempt(self, seq, block_manager):
        block_manager.deallocate(seq)
        return Preemption(SequenceStatus.PREEMPTED)


class Swap(PreemptionPolicy):
    """The victim's computed blocks are copied to a CPU pool and back on readmission, instead
    of being recomputed; when the CPU pool has no room it is recomputed (a fallback).

    The copies go into the step's ``blocks_to_swap_out`` / ``blocks_to_swap_in`` as
    ``(src, dst)`` pairs, for whoever owns the KV tensors. A swapped-in sequence's CPU blocks
    are released once the step that copied them back has run.
    """

    name = "swap"

    def __init__(self, num_cpu_blocks: int):
        check_int("num_cpu_blocks", num_cpu_blocks, minimum=1)
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_pool = CpuBlockPool(num_cpu_blocks)

    def preempt(self, seq, block_manager):
        device_blocks, num_computed = block_manager.computed_blocks(seq), seq.num_cached_tokens
        if not self.cpu_pool.can_swap_out(len(device_blocks)):
            block_manager.deallocate(seq)
            return Preemption(SequenceStatus.PREEMPTED, fallback=True)
        block_manager.deallocate(seq)
        cpu_blocks = self.cpu_pool.swap_out(seq.seq_id, len(device_blocks), num_computed)
        # Safe although the freed blocks may be handed out again in this same step: the copies
        # run before the forward pass that writes them.
        return Preemption(SequenceStatus.SWAPPED, list(zip(device_blocks, cpu_blocks)))

    def swap_in(self, seq, block_manager):
        num_computed = self.cpu_pool.num_computed_tokens(seq.seq_id)
        if not block_manager.can_swap_in(seq, num_computed):
            return None
        block_manager.allocate_for_swap_in(seq, num_computed)
        seq.num_cached_tokens = num_computed
        return list(zip(self.cpu_pool.block_table(seq.seq_id), block_manager.computed_blocks(seq)))

    def release(self, seq):
        if seq.seq_id in self.cpu_pool:
            self.cpu_pool.release(seq.seq_id)

    def step_done(self, seqs):
        # A sequence scheduled in the step it was swapped in read its CPU blocks: they are free now.
        for seq in seqs:
            if seq.seq_id in self.cpu_pool:
                self.cpu_pool.release(seq.seq_id)


PREEMPTION_POLICIES = {"recompute": Recompute, "swap": Swap}


def check_preemption_mode(preemption_mode: str, num_cpu_blocks: int | None) -> None:
    """The rule between ``preemption_mode`` and ``num_cpu_blocks`` (``EngineConfig`` checks it
    through here too): "swap" needs a CPU pool of at least one block, "recompute" none."""
    if not isinstance(preemption_mode, str) or preemption_mode not in PREEMPTION_POLICIES:
        raise ValueError(f"preemption_mode must be one of {tuple(PREEMPTION_POLICIES)} or a PreemptionPolicy, "
                         f"got {preemption_mode!r}")
    if num_cpu_blocks is not None:
        check_int("num_cpu_blocks", num_cpu_blocks, minimum=0)
    if preemption_mode == "swap" and not num_cpu_blocks:
        raise ValueError(f"preemption_mode='swap' needs a CPU block pool to swap to, but num_cpu_blocks="
                         f"{num_cpu_blocks!r}; pass num_cpu_blocks >= 1, or use preemption_mode='recompute'")
    if preemption_mode == "recompute" and num_cpu_blocks:
        raise ValueError(f"num_cpu_blocks={num_cpu_blocks!r} sizes the CPU pool of preemption_mode='swap'; "
                         "with preemption_mode='recompute' nothing is swapped (leave it None)")


def make_preemption_policy(preemption_mode, num_cpu_blocks: int | None = None) -> PreemptionPolicy:
    """``preemption_mode`` by name ("recompute", or "swap" with ``num_cpu_blocks``), or a
    ``PreemptionPolicy`` as it is."""
    if isinstance(preemption_mode, PreemptionPolicy):
        return preemption_mode
    check_preemption_mode(preemption_mode, num_cpu_blocks)
    return Swap(num_cpu_blocks) if preemption_mode == "swap" else Recompute()
