"""The Scheduler: which sequences run in the next step, and how many tokens each (chapter 06).

Two queues hold every live request: ``waiting`` (not yet prefilled, or preempted) and
``running`` (prompt done, decoding one token per step). Each call to ``schedule`` builds one
engine step, which is either

* a **prefill step**: sequences from the head of ``waiting``, each computing the tokens its
  prefix-cache hit did not cover, up to ``max_num_batched_tokens`` tokens in all. A prompt
  that does not fit in what is left of the budget is *chunked*: it computes what fits, keeps
  its blocks and its place at the head of ``waiting``, and continues in the next step; or
* a **decode step**: every running sequence computes its newest token. A sequence whose new
  token starts a block it cannot get *preempts* the most recently admitted running sequence:
  the victim releases its blocks and goes back to the head of ``waiting``, to be recomputed
  (its prompt plus what it generated so far) when blocks are free again.

Prefill has priority (as in Nano-vLLM): new requests join the batch as soon as blocks allow,
which is what *continuous batching* means -- the batch changes at every step, not once per
batch of requests.

After the model has run, ``postprocess`` advances ``seq.num_cached_tokens`` by the tokens the
step computed and calls ``hash_blocks``, so only blocks whose K/V exist are ever offered as
prefix-cache hits. Like the BlockManager it works on numbers only and imports no torch.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from course_pkg.block_manager import BlockManager
from course_pkg.sequence import Sequence, SequenceStatus


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


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


class Scheduler:
    """Continuous batching over one BlockManager: admission, chunked prefill, preemption."""

    def __init__(self, num_kvcache_blocks: int, block_size: int = 16, *,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 eos_token_id: int | Iterable[int] | None = None, free_queue: str = "deque",
                 block_manager: BlockManager | None = None):
        """``block_manager``: an existing manager to schedule over (e.g. a course foil such as
        ``foils.ForwardReleaseBlockManager``), instead of a new ``BlockManager`` built from
        ``num_kvcache_blocks``, ``block_size``, ``enable_prefix_caching`` and ``free_queue``.
        Its pool size and block size must equal ``num_kvcache_blocks`` and ``block_size``;
        prefix caching and the free queue are then the given manager's own.
        """
        _positive_int("max_num_seqs", max_num_seqs)
        _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if max_model_len is not None:
            _positive_int("max_model_len", max_model_len)
        if block_manager is None:
            block_manager = BlockManager(num_kvcache_blocks, block_size, enable_prefix_caching,
                                         free_queue=free_queue)
        elif (block_manager.num_blocks, block_manager.block_size) != (num_kvcache_blocks, block_size):
            raise ValueError(f"block_manager has {block_manager.num_blocks} blocks of {block_manager.block_size} "
                             f"tokens, but num_kvcache_blocks={num_kvcache_blocks!r} and block_size={block_size!r}")
        self.block_manager = block_manager
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        if eos_token_id is None:
            eos = ()
        elif isinstance(eos_token_id, int):
            eos = (eos_token_id,)
        else:
            eos = tuple(eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.preempted: list[Sequence] = []  # sent back to waiting by the latest schedule()
        self.stats = SchedulerStats()

    # ---------------------------------------------------------------- requests

    def max_blocks_needed(self, seq: Sequence) -> int:
        """Blocks ``seq`` holds at its longest: every token but the last one generated is stored.

        The final token is sampled and returned, never fed back, so its K/V are never written.
        """
        final_len = seq.num_prompt_tokens + seq.max_tokens
        if self.max_model_len is not None:
            final_len = min(final_len, self.max_model_len)
        return (final_len - 1 + self.block_size - 1) // self.block_size

    def add(self, seq: Sequence) -> None:
        """Queue a new request, or raise if it can never run (and queue nothing)."""
        self.check(seq)
        self.waiting.append(seq)
        self.stats.prompt_tokens += seq.num_prompt_tokens

    def check(self, seq: Sequence) -> None:
        """Raise ``ValueError`` if ``seq`` cannot be added; change nothing either way.

        A sequence that needs more blocks than the whole pool would preempt itself forever,
        so it is refused here instead of looping in ``schedule``.
        """
        if seq.block_size != self.block_size:
            raise ValueError(f"sequence {seq.seq_id} uses block_size {seq.block_size}, "
                             f"the scheduler uses {self.block_size}")
        if seq.status != SequenceStatus.WAITING or seq.block_table or seq.num_completion_tokens:
            raise ValueError(f"sequence {seq.seq_id} is not a new request (status {seq.status.name}, "
                             f"{seq.num_completion_tokens} generated tokens)")
        if any(s is seq for s in self.waiting) or any(s is seq for s in self.running):
            raise ValueError(f"sequence {seq.seq_id} was already added")
        if self.max_model_len is not None and seq.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"prompt of sequence {seq.seq_id} has {seq.num_prompt_tokens} tokens; "
                             f"max_model_len={self.max_model_len} leaves no room to generate "
                             f"(the prompt must be shorter than max_model_len)")
        needed = self.max_blocks_needed(seq)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"sequence {seq.seq_id} can never fit in the KV cache: its prompt ({seq.num_prompt_tokens} "
                f"tokens) plus up to {seq.max_tokens} generated tokens need {needed} blocks of "
                f"{self.block_size} tokens, the pool has {self.block_manager.num_blocks}; "
                f"use a larger pool, a shorter prompt or a smaller max_tokens")

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    # ---------------------------------------------------------------- one step

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Choose the sequences of the next step: ``(seqs, is_prefill)``.

        Each chosen sequence has ``num_scheduled_tokens`` set: it computes tokens
        ``[num_cached_tokens, num_cached_tokens + num_scheduled_tokens)``. Sequences preempted
        on the way are listed in ``self.preempted``.
        """
        self.preempted = []
        scheduled = self._schedule_prefill()
        if scheduled:
            self.stats.num_prefill_steps += 1
            return scheduled, True
        scheduled = self._schedule_decode()
        if scheduled:
            self.stats.num_decode_steps += 1
        return scheduled, False

    def _schedule_prefill(self) -> list[Sequence]:
        bm = self.block_manager
        scheduled: list[Sequence] = []
        num_batched_tokens = 0
        while self.waiting and num_batched_tokens < self.max_num_batched_tokens:
            seq = self.waiting[0]
            continuing = bool(seq.block_table)  # a chunked prompt from the last step
            if not continuing:
                if len(self.running) >= self.max_num_seqs:  # (admitted prompts are in running)
                    break
                num_cached_blocks = bm.can_allocate(seq)
                if num_cached_blocks == -1:  # first come, first served: no overtaking
                    break
                bm.allocate(seq, num_cached_blocks)  # counts prefix-cache queries and hits
            num_new_tokens = seq.num_tokens - seq.num_cached_tokens
            seq.num_scheduled_tokens = min(num_new_tokens, self.max_num_batched_tokens - num_batched_tokens)
            num_batched_tokens += seq.num_scheduled_tokens
            scheduled.append(seq)
            if seq.num_scheduled_tokens < num_new_tokens:
                break  # chunked: the budget is spent; the rest of this prompt comes next step
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
        self.stats.prefill_kv_computed_tokens += num_batched_tokens
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        bm = self.block_manager
        scheduled: list[Sequence] = []
        # Each decoding sequence computes one token: the token budget caps the batch too.
        while self.running and len(scheduled) < self.max_num_batched_tokens:
            seq = self.running.popleft()
            while not bm.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())  # the most recently admitted gives way
                else:
                    self.preempt(seq)
                    break
            else:
                bm.may_append(seq)
                seq.num_scheduled_tokens = seq.num_tokens - seq.num_cached_tokens  # == 1
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))  # keep admission order: the last is preempted first
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and put it first in line; it is recomputed on readmission."""
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        seq.num_preemptions += 1
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)
        self.preempted.append(seq)
        self.stats.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[int | None]) -> list[Sequence]:
        """Record a step's results; return the sequences that finished.

        ``token_ids[i]`` is the token sampled for ``seqs[i]``, or None when that sequence
        computed only a chunk of its prompt (there is nothing to sample yet).
        """
        self._check_step_results(seqs, token_ids)
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            # The step wrote the K/V of the scheduled tokens: they are cached now, and the
            # blocks they completed can be offered to other sequences.
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.hash_blocks(seq)
            if token_id is None:  # a chunk of a prompt: nothing to sample yet
                continue
            seq.append_token(token_id)
            self.stats.generation_tokens += 1
            if self._is_done(seq, token_id):
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished

    def _check_step_results(self, seqs: list[Sequence], token_ids: list[int | None]) -> None:
        """Raise ``ValueError`` unless the results fit the step ``schedule`` built; change nothing.

        Checked for the whole batch first, so a bad entry cannot leave earlier ones applied.
        """
        if len(seqs) != len(token_ids):
            raise ValueError(f"{len(seqs)} sequences but {len(token_ids)} token ids")
        if len({id(seq) for seq in seqs}) != len(seqs):
            raise ValueError("a sequence appears twice in one step's results")
        for seq, token_id in zip(seqs, token_ids):
            if seq.num_scheduled_tokens < 1 or not seq.block_table:
                raise ValueError(f"sequence {seq.seq_id} has no tokens scheduled in this step "
                                 f"(not scheduled, or its results were already recorded)")
            completes = seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens
            if completes and token_id is None:
                raise ValueError(f"sequence {seq.seq_id} computed its last token but got no sampled token")
            if not completes and token_id is not None:
                raise ValueError(f"sequence {seq.seq_id} computed only a chunk of its prompt; "
                                 f"its token must be None, got {token_id!r}")

    def _is_done(self, seq: Sequence, token_id: int) -> bool:
        if not seq.ignore_eos and token_id in self.eos_token_ids:
            return True
        if seq.num_completion_tokens >= seq.max_tokens:
            return True
        return self.max_model_len is not None and seq.num_tokens >= self.max_model_len
