"""The Scheduler: which sequences run in the next step, and how many tokens each (chapter 06).

Two queues hold every live request: ``waiting`` (prompt tokens still to compute: new,
preempted or swapped requests, and a prompt chunked by the last step) and ``running``
(prompt done, decoding one token per step). One step is a conversation of two calls, as in
vLLM v1::

    out = scheduler.schedule()                    # a SchedulerOutput: what this step does
    ... the model runner performs ``out`` ...       # copies, forward pass, sampling
    finished = scheduler.update_from_output(out, model_runner_output)

``schedule`` decides everything the step will do and returns it as one frozen value: the
sequences and their token counts, the preemptions, the block copies, the forks, the
registrations. Nothing else is read from the scheduler in between. ``update_from_output``
records the results: the tokens computed are cached now, sampled tokens are appended, the
sequences that finished release their blocks.

A step is a transaction (``course_pkg.undo``): ``schedule`` opens it and
``update_from_output`` commits it. The scheduler's journal records every change made in
between -- to the queues, the block manager, the CPU pool, the sequences, the counters -- by
itself: the code below is plain. If anything raises in between, ``unschedule`` (or the failing
call itself) plays the journal backwards: the scheduler is exactly as before the step, and the
same step can be scheduled again.

Which prompts and decodes share a step is the *admission policy* (``scheduling``), what a
preempted sequence gives up is the *preemption policy* (``preemption_mode``); both are small
objects in ``course_pkg.policies``. Like the BlockManager, the Scheduler works on numbers
only and imports no torch.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat

from course_pkg.beam_search import BeamSearch, BeamStep
from course_pkg.block import Block
from course_pkg.block_manager import BlockManager, PrefixCacheStats
from course_pkg.free_block_queue import FreeBlockQueue
from course_pkg.hybrid_block_manager import HybridBlockManager, SlidingWindowManager
from course_pkg.offload.connector import KVTransferConfig, OffloadingConnector
from course_pkg.offload.disk import DiskTier
from course_pkg.offload.linked_dict import LinkedDict
from course_pkg.offload.manager import FilterReusedOffloadingManager, OffloadingManager, OffloadStats, TierBlock
from course_pkg.policies import (AdmissionPolicy, PreemptionPolicy, StepBuilder, make_admission_policy,
                                 make_preemption_policy)
from course_pkg.sampling_params import BeamSearchParams
from course_pkg.sequence import Sequence, SequenceStatus, check_transition
from course_pkg.swap import CpuBlockPool
from course_pkg.undo import Journal, journal_of, share
from course_pkg.validation import check_bool, check_int, check_positive_int, check_token_ids, is_int



@dataclass
class SchedulerStats:
    """Counters since the scheduler was created, named after vLLM's metrics.

    ``prefill_kv_computed_tokens`` is what prefill steps actually computed: the tokens the
    prefix cache did not provide (a preempted sequence's recomputation included). The
    prefix-cache queries and hits themselves are counted by the BlockManager
    (``block_manager.prefix_cache_stats``), once per admission.
    """

    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefill_kv_computed_tokens: int = 0
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    num_mixed_steps: int = 0        # scheduling="mixed": steps holding decodes and prompt chunks
    num_swapped_out: int = 0        # preemptions that swapped the victim's blocks to the CPU pool
    num_swapped_in: int = 0
    num_swap_fallbacks: int = 0     # swap preemptions recomputed instead: the CPU pool was full


@dataclass
class SpecDecodingStats:
    """Counters since start, as vLLM v1 exports them.

    A *draft* is one sequence's proposal in one step (at least one token): ``num_drafts``
    counts them, ``num_draft_tokens`` their tokens, ``num_accepted_tokens`` the tokens that
    verification accepted, ``num_accepted_tokens_per_pos[i]`` how often draft position ``i``
    (0-based) was accepted -- it falls with ``i``, since a draft counts only after every earlier
    one was accepted.
    """

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything one step does, decided by ``Scheduler.schedule`` (vLLM v1's name).

    Per scheduled sequence, in batch order: the tokens already computed
    (``num_computed_tokens``), the tokens this step computes (``num_scheduled_tokens``: tokens
    ``[computed, computed + scheduled)``), and how many tokens the step samples for it
    (``num_samples``): 0 for a chunk in the middle of a prompt, 1 normally, ``n`` when a
    request of ``n`` completions samples its first tokens -- the sequence then forks into
    ``n``. The block copies are ``(src, dst)`` block ids, to be made before the forward pass
    in this order: stores into the tier (device block to tier slot, and with a disk tier
    ``(device block, hash, digest)`` written to disk; chapter 15), swap-outs (device to CPU),
    copy-on-write, swap-ins (CPU to device), loads from the tier (tier slot to device block, and
    ``(bytes read from disk, device block)``), so every read of a block comes before any write into it. ``registered_blocks`` are the blocks
    registered in the prefix index when scheduled (``same_step_prefix_hits``).

    Speculative decoding (chapter 14): ``num_lookahead_tokens[i]`` slots after a decoding
    sequence's last token are allocated for drafts, and counted in its ``num_scheduled_tokens``
    (empty when the scheduler does not speculate). The model runner proposes at most that many
    drafts, verifies them, and returns the accepted ones plus one token of the target's. A
    proposer that needs no model (n-gram) is run by the scheduler before the slots are taken:
    ``scheduled_spec_decode_tokens[i]`` are then the drafts to verify (vLLM's name), exactly
    one per lookahead slot.

    Beam search (chapter 08): ``num_logprobs[i]`` is how many of its most likely next tokens,
    with their log-probabilities, the runner returns for a beam that samples in this step
    (``2 * beam_width``; 0 for a chunk of the root's prompt and for any other sequence; empty
    when no beam search runs) -- vLLM's ``SamplingParams.logprobs``.

    The value is frozen; the sequences in it are the live objects, whose tokens and block
    tables the model runner reads -- nothing changes them between ``schedule`` and
    ``update_from_output``.
    """

    step: int
    seqs: tuple[Sequence, ...]
    num_computed_tokens: tuple[int, ...]
    num_scheduled_tokens: tuple[int, ...]
    num_samples: tuple[int, ...]
    is_prefill: bool
    preempted: tuple[Sequence, ...] = ()
    blocks_to_swap_out: tuple[tuple[int, int], ...] = ()
    blocks_to_copy: tuple[tuple[int, int], ...] = ()
    blocks_to_swap_in: tuple[tuple[int, int], ...] = ()
    registered_blocks: tuple[int, ...] = ()
    blocks_to_store: tuple[tuple[int, int], ...] = ()
    blocks_to_load: tuple[tuple[int, int], ...] = ()
    blocks_to_store_on_disk: tuple[tuple[int, int, bytes], ...] = ()
    blocks_to_load_from_disk: tuple[tuple[bytes, int], ...] = ()
    num_lookahead_tokens: tuple[int, ...] = ()
    scheduled_spec_decode_tokens: tuple[tuple[int, ...], ...] = ()
    num_logprobs: tuple[int, ...] = ()

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def forks(self) -> tuple[tuple[Sequence, int], ...]:
        """``(sequence, n)`` for every sequence that forks into ``n`` completions in this step."""
        return tuple((s, n) for s, n in zip(self.seqs, self.num_samples) if n > 1)


@dataclass
class StepPlan:
    """The step being built inside ``schedule``; frozen into a ``SchedulerOutput`` at the end."""

    seqs: list[Sequence] = field(default_factory=list)
    num_prompt_seqs: int = 0
    num_decode_seqs: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    registered_blocks: list[int] = field(default_factory=list)
    blocks_to_store: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_load: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_store_on_disk: list[tuple[int, int, bytes]] = field(default_factory=list)
    blocks_to_load_from_disk: list[tuple[bytes, int]] = field(default_factory=list)
    # Speculative decoding, by seq_id: the lookahead slots granted, the drafts proposed here.
    num_lookahead_tokens: dict[int, int] = field(default_factory=dict)
    scheduled_spec_decode_tokens: dict[int, list[int]] = field(default_factory=dict)


def check_same_step_prefix_hits(same_step_prefix_hits: bool, enable_prefix_caching: bool) -> None:
    """The rule between the two (``EngineConfig`` checks it through here too): a block can be
    found in the step that fills it only if blocks are registered at all."""
    if same_step_prefix_hits and not enable_prefix_caching:
        raise ValueError("same_step_prefix_hits=True needs prefix caching, but enable_prefix_caching is False")


class Scheduler:
    """Continuous batching over one BlockManager: admission, chunked prefill, preemption.

    The Scheduler owns every request's fate: it alone moves a sequence between ``waiting``
    and ``running``, sets its status (one checked transition, ``sequence.check_transition``),
    decides when and why it finished, and aborts it.
    """

    def __init__(self, num_kvcache_blocks: int, block_size: int, *,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 eos_token_id: int | Iterable[int] | None = None,
                 block_manager: BlockManager | None = None,
                 scheduling: str | AdmissionPolicy = "prefill_first",
                 preemption_mode: str | PreemptionPolicy = "recompute", num_cpu_blocks: int | None = None,
                 same_step_prefix_hits: bool = False, num_lookahead_tokens: int = 0, proposer=None,
                 kv_transfer_config: dict | KVTransferConfig | None = None, disk_tier: DiskTier | None = None,
                 transactional: bool = True):
        """``block_manager``: an existing manager to schedule over (the engine's, built with its
        ``free_queue``; or a course foil such as ``foils.ForwardReleaseBlockManager``), instead of
        a new ``BlockManager(num_kvcache_blocks, block_size, enable_prefix_caching)``. Its pool
        size and block size must equal ``num_kvcache_blocks`` and ``block_size``; prefix caching
        and the free queue are then the given manager's own.

        ``scheduling`` and ``preemption_mode`` name a policy of ``course_pkg.policies`` (or
        are one); ``num_cpu_blocks`` sizes the CPU pool of ``preemption_mode="swap"``;
        ``same_step_prefix_hits`` registers blocks when they are scheduled (chapter 09).
        ``num_lookahead_tokens``: slots for up to that many draft tokens per decoding sequence
        and step (speculative decoding, chapter 14; 0: none). ``proposer``: a torch-free one
        (``NgramProposer``) that the scheduler runs itself, so that it takes slots only for
        drafts that exist; None: the model runner proposes into the slots.
        ``kv_transfer_config``: a tier behind the device pool (chapter 15,
        ``offload.connector.KVTransferConfig``; it needs prefix caching: blocks are found by hash),
        with ``disk_tier`` (an ``offload.disk.DiskTier``) when it names a disk tier.

        ``transactional=False``: the journal enrols nothing, so a step that raises is not undone
        -- for a simulation that runs no model (``workloads.harness.simulate``), where the
        journal would only double the time of every step.

        The keyword defaults are for a Scheduler used on its own (chapters 03-09 and the
        tests); ``LLMEngine`` passes every one of them from its ``EngineConfig``, where the
        engine's defaults and the rules between fields are decided.
        """
        self.admission = make_admission_policy(scheduling)
        self.preemption = make_preemption_policy(preemption_mode, num_cpu_blocks)
        check_bool("same_step_prefix_hits", same_step_prefix_hits)
        check_int("num_lookahead_tokens", num_lookahead_tokens, minimum=0)
        check_positive_int("max_num_seqs", max_num_seqs)
        check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if max_model_len is not None:
            check_positive_int("max_model_len", max_model_len)
        check_bool("enable_prefix_caching", enable_prefix_caching)
        if block_manager is None:
            block_manager = BlockManager(num_kvcache_blocks, block_size, enable_prefix_caching)
        elif (block_manager.num_blocks, block_manager.block_size) != (num_kvcache_blocks, block_size):
            raise ValueError(f"block_manager has {block_manager.num_blocks} blocks of {block_manager.block_size} "
                             f"tokens, but num_kvcache_blocks={num_kvcache_blocks!r} and block_size={block_size!r}")
        if journal_of(block_manager) is not None:
            raise ValueError("block_manager belongs to another Scheduler already; give each Scheduler its own")
        check_same_step_prefix_hits(same_step_prefix_hits, block_manager.enable_prefix_caching)
        if isinstance(block_manager, HybridBlockManager) and kv_transfer_config:
            raise ValueError("a hybrid model's KV cache groups cannot be offloaded to a tier yet (chapter 16): "
                             "pass no kv_transfer_config, or disable_hybrid_kv_cache_manager=True")
        self.block_manager = block_manager
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        if eos_token_id is None:
            eos = []
        elif is_int(eos_token_id):
            eos = [eos_token_id]
        else:
            eos = list(eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(check_token_ids("eos_token_id", eos))
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.stats = SchedulerStats()
        self.num_lookahead_tokens = num_lookahead_tokens
        self.proposer = proposer
        self.spec_decoding_stats = SpecDecodingStats(num_lookahead_tokens)
        self.same_step_prefix_hits = same_step_prefix_hits
        self.cpu_pool: CpuBlockPool | None = self.preemption.cpu_pool
        self.offload: OffloadingConnector | None = None   # the tier's side here (chapter 15)
        if kv_transfer_config is not None:
            kv_transfer_config = KVTransferConfig.from_dict(kv_transfer_config)
            kv_transfer_config.check_pool(block_size, block_manager.enable_prefix_caching)
            self.offload = kv_transfer_config.make_connector(block_manager, disk_tier)
        self.beam_searches: dict[int, BeamSearch] = {}   # request id -> its beam search (chapter 08)
        self.num_steps = 0
        # The step's transaction: from here on, every change to this scheduler and what it holds
        # (the block manager, its blocks, the CPU pool, the sequences) is journaled by itself.
        check_bool("transactional", transactional)
        self.journal = Journal(follow=STEP_STATE if transactional else ())
        self.journal.adopt(self)   # (with nothing followed: enrols nothing)

    @property
    def scheduling(self) -> str:
        return self.admission.name

    @property
    def preemption_mode(self) -> str:
        return self.preemption.name

    # ---------------------------------------------------------------- requests

    def max_blocks_needed(self, seq: Sequence, n: int | None = None) -> int:
        """Blocks ``seq``'s request holds at its longest: every token but the last one generated
        is stored (the final token is sampled and returned, never fed back).

        With ``n`` completions (default: its ``SamplingParams.n``; a beam search's
        ``beam_width``), the full blocks of the prompt are shared by all of them and every
        completion holds the rest on its own.
        """
        n = seq.sampling_params.n if n is None else n
        per_completion = (self._final_len(seq) - 1 + self.block_size - 1) // self.block_size
        shared = min(seq.num_prompt_tokens // self.block_size, per_completion)
        needed = shared + n * (per_completion - shared)
        if isinstance(self.block_manager, HybridBlockManager):   # the other KV cache groups (chapter 16)
            needed += self.block_manager.group_blocks_needed(needed)
        return needed

    def _final_len(self, seq: Sequence) -> int:
        """The most tokens ``seq`` can reach: its prompt plus ``max_tokens``, within ``max_model_len``."""
        final_len = seq.num_prompt_tokens + seq.max_tokens
        return final_len if self.max_model_len is None else min(final_len, self.max_model_len)

    def add(self, seq: Sequence) -> None:
        """Queue a new request, or raise if it can never run (and queue nothing)."""
        self.add_all([seq])

    def add_all(self, seqs: list[Sequence], *, then=None) -> None:
        """Queue several new requests in order: all of them, or -- if one is refused -- none.

        ``then()``, if given, runs inside the same transaction once they are queued: the caller's
        own record of them (the engine's request table) stands or falls with the queueing."""
        seqs = list(seqs)
        for seq in seqs:
            self.check(seq)
        if self.beam_searches:
            raise RuntimeError("a beam search is running: it runs alone (its beams step together); "
                               "let it finish or abort it first")
        if len({id(s) for s in seqs}) != len(seqs):
            raise ValueError("the same sequence appears twice among the requests to add")
        with self._transaction(opens="add a request", commits=True):
            for seq in seqs:
                self.waiting.append(seq)   # (first: that enrols it, so the lines below are journaled)
                seq.submitted = True
                self.stats.prompt_tokens += seq.num_prompt_tokens
            if then is not None:
                then()

    def add_beam_search(self, seq: Sequence, params: BeamSearchParams, *, then=None) -> BeamSearch:
        """Queue ``seq`` as the root of a beam search of ``params.beam_width`` beams (chapter 08;
        :mod:`course_pkg.beam_search`), and return the search. ``then(search)``, if given, runs
        inside the same transaction, as in ``add_all``.

        The search runs alone: it is refused while anything else waits or runs, and nothing is
        added beside it. So that its beams always step together, it is also refused unless all
        ``beam_width`` of them, at their longest, fit in the pool, in ``max_num_seqs`` and in
        one step's ``max_num_batched_tokens``.
        """
        self.check_beam_search(seq, params)
        search = BeamSearch(seq, params, self.eos_token_ids)

        def record() -> None:   # (inside add_all's transaction)
            self.beam_searches[seq.request_id] = search
            if then is not None:
                then(search)

        self.add_all([seq], then=record)
        return search

    def check_beam_search(self, seq: Sequence, params: BeamSearchParams) -> None:
        """Raise unless ``add_beam_search(seq, params)`` would queue it; change nothing."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        k = params.beam_width
        self.check(seq, n=k)
        if seq.max_tokens != params.max_tokens or seq.sampling_params.n != 1:
            raise ValueError(f"the root of a beam search samples one token at a time up to max_tokens="
                             f"{params.max_tokens}: its SamplingParams have n={seq.sampling_params.n}, "
                             f"max_tokens={seq.max_tokens}")
        if self.max_model_len is not None and seq.num_prompt_tokens + params.max_tokens > self.max_model_len:
            raise ValueError(f"the prompt's {seq.num_prompt_tokens} tokens plus max_tokens={params.max_tokens} "
                             f"exceed max_model_len={self.max_model_len}: every hypothesis is max_tokens long "
                             f"unless it stops")
        if k > self.max_num_batched_tokens:
            raise ValueError(f"beam_width={k} beams decode together, but a step computes at most "
                             f"max_num_batched_tokens={self.max_num_batched_tokens} tokens")
        if not self.is_finished() or self.beam_searches:
            raise RuntimeError("a beam search runs alone (its beams step together): finish or abort "
                               "the queued requests first")

    def check(self, seq: Sequence, n: int | None = None) -> None:
        """Raise ``ValueError`` if ``seq`` cannot be added; change nothing either way.

        A sequence that needs more blocks than the whole pool would preempt itself forever,
        and one of ``n`` completions with ``n > max_num_seqs`` could never be admitted, so both
        are refused here instead of looping in ``schedule``. A sequence is a request submitted
        once: one already added (here or to another scheduler) is refused.
        """
        if not isinstance(seq, Sequence):
            raise TypeError(f"expected a Sequence, got {type(seq).__name__}")
        if seq.block_size != self.block_size:
            raise ValueError(f"sequence {seq.seq_id} uses block_size {seq.block_size}, "
                             f"the scheduler uses {self.block_size}")
        if seq.submitted:
            raise ValueError(f"sequence {seq.seq_id} was already added to a scheduler")
        if seq.status != SequenceStatus.WAITING or seq.block_table or seq.num_completion_tokens:
            raise ValueError(f"sequence {seq.seq_id} is not a new request (status {seq.status.name}, "
                             f"{seq.num_completion_tokens} generated tokens)")
        if self.max_model_len is not None and seq.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"prompt of sequence {seq.seq_id} has {seq.num_prompt_tokens} tokens; "
                             f"max_model_len={self.max_model_len} leaves no room to generate "
                             f"(the prompt must be shorter than max_model_len)")
        n = seq.sampling_params.n if n is None else n   # (a beam search's: its beam_width)
        if n > self.max_num_seqs:
            raise ValueError(f"sequence {seq.seq_id} asks for n={n} completions, but max_num_seqs="
                             f"{self.max_num_seqs} sequences can run at once; use n <= max_num_seqs")
        needed = self.max_blocks_needed(seq, n)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"sequence {seq.seq_id} can never fit in the KV cache: its prompt ({seq.num_prompt_tokens} "
                f"tokens) plus up to {seq.max_tokens} generated tokens"
                + (f" for each of {n} completions" if n > 1 else "")
                + f" need {needed} blocks of {self.block_size} tokens, the pool has "
                f"{self.block_manager.num_blocks}; use a larger pool, a shorter prompt or a smaller "
                + ("max_tokens or n" if n > 1 else "max_tokens"))

    def is_finished(self) -> bool:
        """No request waits or runs."""
        return not self.waiting and not self.running

    def holds(self, seq: Sequence) -> bool:
        """Is ``seq`` waiting or running here?"""
        return any(s is seq for queue in (self.waiting, self.running) for s in queue)

    def abort(self, seq: Sequence, *, then=None) -> None:
        """Finish ``seq`` as FINISHED_ABORTED, releasing its blocks (a transaction of its own;
        ``then()``, if given, runs inside it, as in ``add_all``).

        Aborting a beam of a beam search aborts the search: all its beams, at once.

        Raises ``ValueError`` for a sequence this scheduler does not hold, and
        ``RuntimeError`` while a step is open.
        """
        if not self.holds(seq):
            raise ValueError(f"sequence {seq.seq_id} is not held by this scheduler "
                             f"(never added, or already finished)")
        with self._transaction(opens="abort a request", commits=True):
            search = self.beam_searches.pop(seq.request_id, None)
            for s in search.beams if search is not None else [seq]:
                if s.block_table:
                    self.block_manager.deallocate(s)
                self.preemption.release(s)
                s.num_scheduled_tokens = 0
                (self.running if s in self.running else self.waiting).remove(s)
                self._set_status(s, SequenceStatus.FINISHED_ABORTED)
            if search is not None:
                search.beams = []
            if then is not None:
                then()

    # ---------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        """Decide the next step and open its transaction; see ``SchedulerOutput``.

        Each scheduled sequence also has ``num_scheduled_tokens`` set. The batch is empty only
        when no request waits or runs. If this raises, nothing has changed.
        """
        with self._transaction(opens="schedule a new step"):
            plan = StepPlan()
            if self.offload is not None:   # the last step's blocks go to the tier first (chapter 15)
                plan.blocks_to_store, plan.blocks_to_store_on_disk = self.offload.begin_step()
            self.admission.schedule(StepBuilder(
                schedule_prompts=partial(self._schedule_prompts, plan), schedule_decodes=partial(self._schedule_decodes, plan),
                has_waiting=lambda: bool(self.waiting), token_budget=self.max_num_batched_tokens))
            if self.num_lookahead_tokens:
                self._schedule_lookahead(plan)
            if not plan.seqs and self.waiting:
                n = len(self.waiting)
                raise RuntimeError(f"nothing could be scheduled although {n} request{'s' if n > 1 else ''} "
                                   f"wait{'' if n > 1 else 's'} and none runs (check() admits only requests that "
                                   "fit in the pool)")
            self._count_step(plan)
            out = SchedulerOutput(
                step=self.num_steps, seqs=tuple(plan.seqs),
                num_computed_tokens=tuple(s.num_cached_tokens for s in plan.seqs),
                num_scheduled_tokens=tuple(s.num_scheduled_tokens for s in plan.seqs),
                num_samples=tuple(self._num_samples(s) for s in plan.seqs),
                is_prefill=plan.num_prompt_seqs > 0, preempted=tuple(plan.preempted),
                blocks_to_swap_out=tuple(plan.blocks_to_swap_out), blocks_to_copy=tuple(plan.blocks_to_copy),
                blocks_to_swap_in=tuple(plan.blocks_to_swap_in), registered_blocks=tuple(plan.registered_blocks),
                blocks_to_store=tuple(plan.blocks_to_store), blocks_to_load=tuple(plan.blocks_to_load),
                blocks_to_store_on_disk=tuple(plan.blocks_to_store_on_disk),
                blocks_to_load_from_disk=tuple(plan.blocks_to_load_from_disk),
                num_lookahead_tokens=tuple(plan.num_lookahead_tokens.get(s.seq_id, 0) for s in plan.seqs)
                if self.num_lookahead_tokens else (),
                scheduled_spec_decode_tokens=tuple(tuple(plan.scheduled_spec_decode_tokens.get(s.seq_id, ()))
                                                   for s in plan.seqs)
                if self.proposer is not None else (),
                num_logprobs=tuple(self.beam_searches[s.request_id].num_logprobs
                                   if s.request_id in self.beam_searches and self._num_samples(s) else 0
                                   for s in plan.seqs) if self.beam_searches else ())
        return out

    def _schedule_prompts(self, plan: StepPlan, budget: int) -> int:
        """Prompt tokens of waiting sequences, up to ``budget`` tokens, first come first served;
        returns the tokens scheduled.

        A prompt that does not fit in what is left of the budget is *chunked*: it computes what
        fits, keeps its blocks and its place in ``waiting``, and continues in the next step. A
        chunked prompt (status RUNNING, still in ``waiting``) goes first, ahead of requests
        preempted since it started: it already holds blocks, which they may be waiting for.
        """
        num_tokens = 0
        for seq in self._prompt_order():
            if num_tokens >= budget:
                break
            if seq.status != SequenceStatus.RUNNING:   # not admitted yet; n completions take n seats
                if len(self.running) + seq.num_samples > self.max_num_seqs or not self._admit(seq, plan):
                    break   # first come, first served: no overtaking
            num_new_tokens = seq.num_tokens - seq.num_cached_tokens
            self._schedule_tokens(plan, seq, min(num_new_tokens, budget - num_tokens), decode=False)
            num_tokens += seq.num_scheduled_tokens
            if seq.num_scheduled_tokens < num_new_tokens:
                break   # chunked: the budget is spent
            self.waiting.remove(seq)
            self.running.append(seq)
        self.stats.prefill_kv_computed_tokens += num_tokens
        return num_tokens

    def _prompt_order(self) -> list[Sequence]:
        """``waiting`` in the order its prompts are served: a partly prefilled prompt first, then
        first come first served. Only preempted requests can stand before that prompt (they
        re-enter at the head, new requests at the tail), so the search stops at the first
        request that is neither."""
        order = list(self.waiting)
        for i, seq in enumerate(order):
            if seq.status == SequenceStatus.RUNNING:
                order.insert(0, order.pop(i))
                break
            if seq.status == SequenceStatus.WAITING:
                break
        return order

    def _schedule_decodes(self, plan: StepPlan) -> int:
        """One token for each running sequence, oldest first, preempting where blocks run out;
        returns the number of sequences scheduled.

        A sequence whose new token starts a block it cannot get preempts a victim
        (``_choose_victim``: the most recently admitted) until it can, or preempts itself.
        """
        bm = self.block_manager
        num_decodes = 0
        i = 0
        # Each decoding sequence computes one token: the token budget caps the batch too.
        while i < len(self.running) and num_decodes < self.max_num_batched_tokens:
            seq = self.running[i]
            while not bm.can_append(seq):
                victim = self._choose_victim(seq)
                self.preempt(victim, plan)
                if victim is seq:   # it was the last one: it gave up its own blocks, and
                    break           # the loop ends (i now points past the end of running)
            else:                   # (no break: seq has its place for the new token)
                plan.blocks_to_copy += bm.may_append(seq)   # copy-on-write of a shared last block
                self._schedule_tokens(plan, seq, 1, decode=True)
                num_decodes += 1
                i += 1
        return num_decodes

    def _schedule_lookahead(self, plan: StepPlan) -> int:
        """Slots for the drafts of speculative decoding (chapter 14; vLLM's
        ``num_lookahead_tokens``), once the admission policy has filled the step: up to
        ``num_lookahead_tokens`` positions after the newest token of every sequence that
        computes only that token and samples one (a decode), within what is left of the token
        budget; returns the slots given.

        Lookahead takes only free blocks -- it never preempts, and the step's decodes and
        prompts had their blocks first -- and never more than the request can still use (a
        step yields at most one token more than its drafts). A sequence that cannot get a block
        for all of them gets fewer: a draft that has no slot is not proposed. The slots of
        rejected drafts are given back in ``update_from_output``.

        With a torch-free ``proposer`` (n-gram) the drafts are proposed first, from the tokens
        the last step left, and slots are taken for exactly those drafts: a sequence whose
        n-gram has no earlier occurrence takes no block at all (vLLM, too, knows the n-gram
        drafts before it schedules them). The early-exit draft runs in the model runner, so
        its slots are taken for ``num_lookahead_tokens`` drafts before any is proposed.
        """
        bm = self.block_manager
        budget = self.max_num_batched_tokens - sum(s.num_scheduled_tokens for s in plan.seqs)
        decodes = [s for s in plan.seqs if s.num_scheduled_tokens == 1 and s.num_cached_tokens == s.num_tokens - 1
                   and self._num_samples(s) == 1]
        total = 0
        for seq in decodes:
            wanted = min(self.num_lookahead_tokens, self._final_len(seq) - seq.num_tokens - 1, budget - total)
            if wanted <= 0:
                continue
            if self.proposer is not None:
                drafts = self.proposer.propose(seq.token_ids, wanted)
                wanted = len(drafts)
                if not wanted:
                    continue
            granted = bm.allocate_lookahead_slots(seq, wanted)
            if granted:
                plan.num_lookahead_tokens[seq.seq_id] = granted
                if self.proposer is not None:
                    plan.scheduled_spec_decode_tokens[seq.seq_id] = drafts[:granted]
                seq.num_scheduled_tokens += granted
                total += granted
        return total

    def _choose_victim(self, seq: Sequence) -> Sequence:
        """The running sequence that gives way when ``seq`` needs a block: the most recently
        admitted (a request's forks sit right after it, so a group is preempted newest first)."""
        return self.running[-1]

    def preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Free a running ``seq``'s device blocks and put it first in line. The preemption
        policy decides what it keeps: nothing (recompute) or a CPU copy of its K/V (swap)."""
        status = self._release_victim(seq, plan)
        self.running.remove(seq)
        self._set_status(seq, status)
        seq.num_scheduled_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.stats.num_preemptions += 1
        plan.preempted.append(seq)

    def _release_victim(self, seq: Sequence, plan: StepPlan) -> SequenceStatus:
        """The preemption policy frees ``seq``'s device blocks; the copies it asks for go into the
        step, and it is counted. Returns the victim's new status (PREEMPTED or SWAPPED)."""
        done = self.preemption.preempt(seq, self.block_manager)
        plan.blocks_to_swap_out += done.blocks_to_swap_out
        if done.fallback:
            self.stats.num_swap_fallbacks += 1
        elif done.status == SequenceStatus.SWAPPED:
            self.stats.num_swapped_out += 1
        return done.status

    def _admit(self, seq: Sequence, plan: StepPlan) -> bool:
        """Give the waiting ``seq`` its blocks, or return False if they do not fit.

        A new or preempted request is allocated (counting its prefix-cache query and hits), and
        the blocks after its hits are loaded from the tier if it holds them (chapter 15); a
        swapped one gets fresh blocks that its K/V are copied back into (the policy does it).
        """
        if seq.status == SequenceStatus.SWAPPED:
            copies = self.preemption.swap_in(seq, self.block_manager)
            if copies is None:
                return False
            plan.blocks_to_swap_in += copies
            self.stats.num_swapped_in += 1
        else:
            num_cached_blocks = self.block_manager.can_allocate(seq)
            if num_cached_blocks == -1:
                return False
            self.block_manager.allocate(seq, num_cached_blocks)
            if self.offload is not None:
                loads, reads = self.offload.load(seq)
                plan.blocks_to_load += loads
                plan.blocks_to_load_from_disk += reads
        self._set_status(seq, SequenceStatus.RUNNING)
        return True

    def _schedule_tokens(self, plan: StepPlan, seq: Sequence, num_tokens: int, *, decode: bool) -> None:
        """``seq`` computes ``num_tokens`` tokens in this step (its decode token, or prompt
        tokens); with ``same_step_prefix_hits`` the blocks they fill are registered now, so
        later sequences of this step can hit them."""
        seq.num_scheduled_tokens = num_tokens
        plan.seqs.append(seq)
        if decode:
            plan.num_decode_seqs += 1
        else:
            plan.num_prompt_seqs += 1
        if self.same_step_prefix_hits:
            before = len(seq.block_hashes)
            self.block_manager.hash_blocks(seq, seq.num_cached_tokens + num_tokens)
            plan.registered_blocks += seq.block_table[before:len(seq.block_hashes)]

    def _num_samples(self, seq: Sequence) -> int:
        """Tokens the step samples for ``seq``: none for a chunk in the middle of its prompt."""
        if seq.num_cached_tokens + seq.num_scheduled_tokens < seq.num_tokens:
            return 0
        return seq.num_samples

    def _count_step(self, plan: StepPlan) -> None:
        if plan.num_prompt_seqs and plan.num_decode_seqs:
            self.stats.num_mixed_steps += 1
        elif plan.num_prompt_seqs:
            self.stats.num_prefill_steps += 1
        elif plan.num_decode_seqs:
            self.stats.num_decode_steps += 1

    # ---------------------------------------------------------------- the step's results

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output, *,
                           commit: bool = True) -> list[Sequence]:
        """Record a step's results and commit it; return the sequences that finished in it.

        ``model_runner_output`` is a ``ModelRunnerOutput`` (or just its ``sampled_token_ids``):
        per scheduled sequence a list of ``num_samples`` sampled token ids (empty for a prompt
        chunk), and optionally their log-probabilities in the same shape. A sequence with
        ``n > 1`` samples forks into ``n`` completions here, sharing all its blocks
        (``BlockManager.fork``). Finished sequences release their blocks -- they stay cached,
        so a chat's next turn may reuse them. If anything raises, the whole step is undone.

        ``commit=False`` leaves the step open after recording it, for a caller that records
        its own part of the step in the same transaction (the engine: its requests' metrics)
        and then calls ``commit_step``.
        """
        out = scheduler_output
        self._check_step_is_open(out)
        with self._transaction(commits=commit):
            token_ids, logprobs = _results(model_runner_output)
            self._check_results(out, token_ids, logprobs)
            drafts = self._check_drafts(out, token_ids, getattr(model_runner_output, "draft_token_ids", None))
            top_logprobs = self._check_top_logprobs(out, getattr(model_runner_output, "top_logprobs", None))
            return self._record(out, token_ids, logprobs, drafts, top_logprobs)

    def commit_step(self) -> None:
        """Commit the step that ``update_from_output(..., commit=False)`` recorded."""
        if not self.journal.recording:
            raise RuntimeError("no step is open")
        self.journal.commit()

    def _record(self, out: SchedulerOutput, token_ids, logprobs, drafts=None, top_logprobs=None) -> list[Sequence]:
        bm = self.block_manager
        finished: list[Sequence] = []
        num_generated = 0
        beam_rows: dict[int, dict[int, list]] = {}   # beam search -> its beams' candidates, by seq_id
        for i, seq in enumerate(out.seqs):
            if out.num_lookahead_tokens and out.num_lookahead_tokens[i]:
                num_generated += self._record_speculative(seq, token_ids[i], logprobs and logprobs[i],
                                                          drafts[i], finished)
                continue
            # The step wrote the K/V of the scheduled tokens: they are cached now.
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            tokens = token_ids[i]
            if not tokens:   # a chunk of a prompt: nothing sampled yet
                continue
            if out.num_logprobs and out.num_logprobs[i]:   # a beam: its search chooses, below
                beam_rows.setdefault(seq.request_id, {})[seq.seq_id] = top_logprobs[i]
                continue
            group = ([seq] + self._fork(seq, len(tokens) - 1)) if out.num_samples[i] > 1 else [seq]
            num_generated += len(tokens)
            for s, t, lp in zip(group, tokens, logprobs[i] if logprobs is not None else repeat(0.0)):
                s.append_token(t)
                s.cumulative_logprob += lp
                status = self._finish_status(s, t)
                if status is not None:
                    self.running.remove(s)
                    self._set_status(s, status)
                    finished.append(s)
        for request_id, rows in beam_rows.items():
            num_generated += self._step_beams(self.beam_searches[request_id], rows, out.blocks_to_copy, finished)
        self.stats.generation_tokens += num_generated
        # Speculation: blocks past the last verified token (rejected drafts, unused slots) go back.
        for seq, lookahead in zip(out.seqs, out.num_lookahead_tokens):
            if lookahead:
                bm.free_lookahead_slots(seq)
        # Offer the blocks the step completed to other sequences -- a finishing sequence's too.
        for seq in out.seqs:
            if seq.block_table:
                bm.hash_blocks(seq)
        if self.offload is not None:   # the tier (chapter 15): the next step stores what this one registered
            self.offload.end_step(out)
        for seq in finished:
            bm.deallocate(seq)
        self.preemption.step_done(out.seqs)
        self.num_steps += 1
        return finished

    def _record_speculative(self, seq: Sequence, tokens: list[int], logprobs, drafts: list[int],
                            finished: list[Sequence]) -> int:
        """Record a speculative decode (chapter 14): ``tokens`` are the accepted drafts and one
        token of the target's. Returns how many were appended.

        The rollback is a count: the step wrote K/V for the last token and every draft, but only
        those of the last token and the *accepted* drafts are kept -- ``num_cached_tokens`` grows
        by the tokens appended, and the rejected drafts' slots are overwritten by the next step
        (``free_lookahead_slots`` gives back the blocks that hold no verified token). A token that
        finishes the request ends it there; what verification accepted after it is dropped.
        """
        seq.num_scheduled_tokens = 0
        appended = 0
        for t, lp in zip(tokens, logprobs if logprobs else repeat(0.0)):
            seq.append_token(t)
            seq.cumulative_logprob += lp
            appended += 1
            status = self._finish_status(seq, t)
            if status is not None:
                self.running.remove(seq)
                self._set_status(seq, status)
                finished.append(seq)
                break
        seq.num_cached_tokens += appended   # the last token and the accepted drafts before the newest
        if drafts:
            self._count_draft(len(drafts), len(tokens) - 1)
        return appended

    def _count_draft(self, num_draft_tokens: int, num_accepted: int) -> None:
        stats = self.spec_decoding_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_draft_tokens
        stats.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            stats.num_accepted_tokens_per_pos[pos] += 1

    def _fork(self, seq: Sequence, num_children: int) -> list[Sequence]:
        """Completions 1 .. num_children of ``seq``'s request: forks sharing its blocks, placed
        right after it in ``running`` (a group is preempted from its newest member on)."""
        children = [seq.fork(j) for j in range(1, num_children + 1)]
        at = self.running.index(seq) + 1
        for j, child in enumerate(children):
            self.block_manager.fork(seq, child)
            self.running.insert(at + j, child)
        seq.children = children
        return children

    def _step_beams(self, search: BeamSearch, rows: dict[int, list], copies, finished: list[Sequence]) -> int:
        """One step of a beam search (chapter 08): ``search.rank`` the candidates of its beams
        (``rows``, by seq_id), then rebuild the beams on the block manager; returns the tokens
        appended. A beam chosen once keeps its sequence, a beam chosen ``m`` times is forked
        ``m - 1`` times, placed right after it in ``running`` (a fork shares every block, the
        partial last one too); a beam not chosen -- every beam, when the search stops -- is
        dropped: it finishes as aborted and joins ``finished``, whose blocks ``_record`` releases
        after the forks, so a block a fork still shares stays alive."""
        beams = search.beams
        if sorted(rows) != sorted(b.seq_id for b in beams):
            raise RuntimeError(f"beam search {search.request_id}: its beams {sorted(b.seq_id for b in beams)} step "
                               f"together, but this step computed {sorted(rows)}")
        held = {block for beam in beams for block in beam.block_table}
        copies = tuple((src, dst) for src, dst in copies if dst in held)   # the copies made for these beams
        for beam in beams:
            self.block_manager.hash_blocks(beam)   # (before the forks, which copy the hashes)
        ranking = search.rank([rows[b.seq_id] for b in beams])
        chosen: dict[int, list[tuple[float, int]]] = {}
        for score, b, token in ([] if ranking.stop else ranking.running):
            chosen.setdefault(b, []).append((score, token))
        next_beams, kept = [], []
        for b, choices in chosen.items():
            parent = beams[b]
            children = [parent.fork(parent.index) for _ in choices[1:]]
            at = self.running.index(parent) + 1
            for j, child in enumerate(children):
                self.block_manager.fork(parent, child)
                self.running.insert(at + j, child)
            for seq, (score, token) in zip([parent] + children, choices):
                seq.append_token(token)
                seq.cumulative_logprob = score
                next_beams.append((score, seq))
                kept.append((seq.seq_id, parent.seq_id, token))
        dropped = [beam for b, beam in enumerate(beams) if b not in chosen]
        for beam in dropped:
            self.running.remove(beam)
            self._set_status(beam, SequenceStatus.FINISHED_ABORTED)
            finished.append(beam)
        next_beams.sort(key=lambda pair: -pair[0])   # best first, as the candidates were
        search.beams = [seq for _, seq in next_beams]
        search.scores = [score for score, _ in next_beams]
        search.finished = ranking.finished
        search.steps.append(BeamStep(step=len(search.steps) + 1, kept=tuple(kept),
                                     pruned=tuple(b.seq_id for b in dropped), finished=tuple(ranking.ended),
                                     copies=copies))
        if ranking.stop:
            del self.beam_searches[search.request_id]
        return len(next_beams)

    def _finish_status(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        """Why ``seq`` finishes with ``token_id`` as its newest token, or None if it goes on."""
        if not seq.ignore_eos and token_id in self.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_completion_tokens >= seq.max_tokens:
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        if self.max_model_len is not None and seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        return None

    def _check_results(self, out: SchedulerOutput, token_ids, logprobs) -> None:
        """Raise ``ValueError`` unless the results fit the step ``schedule`` built; change nothing."""
        if len(token_ids) != len(out.seqs):
            raise ValueError(f"{len(out.seqs)} sequences were scheduled but {len(token_ids)} results came back")
        if logprobs is not None and len(logprobs) != len(out.seqs):
            raise ValueError(f"{len(out.seqs)} sequences were scheduled but {len(logprobs)} logprob lists came back")
        for i, (seq, n, tokens) in enumerate(zip(out.seqs, out.num_samples, token_ids)):
            lookahead = out.num_lookahead_tokens[i] if out.num_lookahead_tokens else 0
            fits = isinstance(tokens, (list, tuple)) and (
                len(tokens) == n if not lookahead else 1 <= len(tokens) <= 1 + lookahead)
            if not fits:
                expected = f"{n}" if not lookahead else f"1 to {1 + lookahead}"
                raise ValueError(f"sequence {seq.seq_id} samples {expected} token(s) in this step: expected a list "
                                 f"of {expected} token ids, got {tokens!r}")
            if logprobs is not None and (not isinstance(logprobs[i], (list, tuple)) or len(logprobs[i]) != len(tokens)):
                raise ValueError(f"sequence {seq.seq_id}: expected {len(tokens)} log-probabilities, "
                                 f"got {logprobs[i]!r}")
            for t in tokens:
                if type(t) is not int or t < 0:   # (not a bool, not a float)
                    raise ValueError(f"sequence {seq.seq_id}: sampled token {t!r} is not a token id "
                                     f"(an integer >= 0)")

    def _check_top_logprobs(self, out: SchedulerOutput, top_logprobs) -> list | None:
        """The candidates of the step's beams (``ModelRunnerOutput.top_logprobs``), checked: per
        beam 1 to ``num_logprobs`` ``(token id, log-probability)`` pairs. Raises ``ValueError``
        otherwise; changes nothing."""
        if not any(out.num_logprobs):
            return None
        if top_logprobs is None or len(top_logprobs) != len(out.seqs):
            raise ValueError("a step with beams needs each beam's most likely next tokens "
                             "(ModelRunnerOutput.top_logprobs)")
        for seq, k, row in zip(out.seqs, out.num_logprobs, top_logprobs):
            if k and (not 1 <= len(row) <= k or not all(
                    isinstance(p, tuple) and len(p) == 2 and type(p[0]) is int and isinstance(p[1], float) for p in row)):
                raise ValueError(f"beam {seq.seq_id}: expected 1 to {k} (token id, log-probability) pairs, got {row!r}")
        return top_logprobs

    def _check_drafts(self, out: SchedulerOutput, token_ids, drafts) -> list[list[int]] | None:
        """The drafts verified per sequence, checked against the step and its results: at most
        its lookahead slots, and every token but the last one a result yields is an accepted
        draft. Raises ``ValueError`` otherwise; changes nothing."""
        if not any(out.num_lookahead_tokens):
            return None
        if drafts is None or len(drafts) != len(out.seqs):
            raise ValueError("a speculative step's results need the drafts verified per sequence "
                             "(ModelRunnerOutput.draft_token_ids)")
        for seq, slots, d, tokens in zip(out.seqs, out.num_lookahead_tokens, drafts, token_ids):
            if len(d) > slots:
                raise ValueError(f"sequence {seq.seq_id} had {slots} lookahead slot(s) but {len(d)} drafts came back")
            if slots and not 1 <= len(tokens) <= len(d) + 1:
                raise ValueError(f"sequence {seq.seq_id}: {len(d)} drafts verified, so 1 to {len(d) + 1} tokens "
                                 f"must come back, got {len(tokens)}")
            if slots and list(tokens[:-1]) != list(d[:len(tokens) - 1]):
                raise ValueError(f"sequence {seq.seq_id}: tokens {list(tokens)} are not accepted drafts of "
                                 f"{list(d)} followed by one token")
        return [list(d) for d in drafts]

    def unschedule(self, scheduler_output: SchedulerOutput | None = None,
                   overwritten: dict[int, int] | None = None) -> None:
        """Undo the open step (its results will not be recorded: the model or the sampler
        raised): every change since ``schedule`` is rolled back, and the next ``schedule``
        decides the same step again. Also finishes a rollback that was interrupted. Does
        nothing when no step is open. (``scheduler_output`` names the step for the reader; a
        scheduler has one open step at most.)

        ``overwritten``: the K/V slots the step wrote before it failed (``ModelRunner.written_slots``),
        ``{block id: first offset written}``. A journal cannot give memory back: those blocks
        lose their prefix-cache entries, and a sequence whose computed tokens were overwritten
        -- a victim the step had preempted and whose blocks it handed on -- is preempted for
        real, by recompute. That clean-up is a transaction of its own: if it is interrupted,
        it is undone, and calling ``unschedule`` again with the same slots finishes the job
        (the slots of blocks already dealt with harm nobody any more).
        """
        if self.journal.recording:
            self.journal.rollback()
        if overwritten:
            self._forget_overwritten(overwritten)

    # ---------------------------------------------------------------- the transaction

    @contextmanager
    def _transaction(self, *, opens: str | None = None, commits: bool = False):
        """One part of a step's transaction: ``opens`` (what is about to happen, for the error
        when a step is open already) begins it, ``commits`` ends it; an exception in the part
        -- on any line, the journal's ``begin`` and ``commit`` included -- undoes the whole step
        unless it came after the commit point, and is re-raised."""
        if opens is not None:
            self._check_no_open_step(opens)
        try:
            if opens is not None:
                self.journal.begin()
            yield
            if commits:
                self.journal.commit()
        except BaseException:
            self.journal.rollback()   # (nothing to undo past the commit point; if interrupted, the
            raise                     # journal stays open and unschedule() carries on)

    def _forget_overwritten(self, written: dict[int, int]) -> None:
        """Deal with the K/V an undone step overwrote (see ``unschedule``): the one change a
        rollback cannot avoid, made as a transaction of its own."""
        with self._transaction(opens="deal with overwritten K/V", commits=True):
            damaged = {id(s) for s in self.block_manager.forget_overwritten(written)}
            if self.offload is not None:
                self.offload.forget_overwritten(written)
            running = [s for s in reversed(self.running) if id(s) in damaged]   # newest first
            chunked = [s for s in self.waiting if id(s) in damaged]   # a prompt part-way through its chunks
            for seq in running + chunked:
                self.block_manager.deallocate(seq)
                check_transition(seq, SequenceStatus.PREEMPTED)
                seq.status = SequenceStatus.PREEMPTED
                seq.num_preemptions += 1
                self.stats.num_preemptions += 1
                if seq in running:
                    self.running.remove(seq)
                    self.waiting.appendleft(seq)

    def _check_no_open_step(self, action: str) -> None:
        if self.journal.recording:
            raise RuntimeError(f"cannot {action}: a step is open (schedule() was called); record it with "
                               f"update_from_output() or undo it with unschedule() first")

    def _check_step_is_open(self, out: SchedulerOutput) -> None:
        if not isinstance(out, SchedulerOutput):
            raise TypeError(f"expected the SchedulerOutput of schedule(), got {type(out).__name__}")
        if not self.journal.recording or out.step != self.num_steps:
            raise ValueError(f"step {out.step} is not the open step of this scheduler (its results were "
                             f"recorded or undone already, or it was never scheduled here)")

    def _set_status(self, seq: Sequence, status: SequenceStatus) -> None:
        check_transition(seq, status)
        seq.status = status


#: What a step may change: the journal enrols the instances of these classes (subclasses too)
#: that a Scheduler holds, and nothing else.
STEP_STATE = (Scheduler, SchedulerStats, SpecDecodingStats, BlockManager, Block, FreeBlockQueue, PrefixCacheStats,
              SlidingWindowManager, CpuBlockPool, Sequence, PreemptionPolicy, BeamSearch,
              OffloadingConnector, OffloadingManager, FilterReusedOffloadingManager, TierBlock, OffloadStats, LinkedDict)
share(Sequence._ids)   # the ids of new sequences: a fork undone gives its id back


def _results(model_runner_output):
    """``(sampled_token_ids, logprobs or None)`` of a ``ModelRunnerOutput`` or a bare list."""
    if isinstance(model_runner_output, (list, tuple)):
        return list(model_runner_output), None
    token_ids = getattr(model_runner_output, "sampled_token_ids", None)
    if token_ids is None:
        raise TypeError(f"expected a ModelRunnerOutput or a list of sampled token id lists, "
                        f"got {type(model_runner_output).__name__}")
    return list(token_ids), getattr(model_runner_output, "logprobs", None)
