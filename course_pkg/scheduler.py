"""The Scheduler: which sequences run in the next step, and how many tokens each (chapter 06).

Two queues hold every live request: ``waiting`` (not yet prefilled, or preempted) and
``running`` (prompt done, decoding one token per step). Each call to ``schedule`` builds one
step -- one forward pass of the model over a batch of sequences -- which is either

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
from course_pkg.validation import check_bool, check_positive_int, check_token_ids, is_int


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
    """Continuous batching over one BlockManager: admission, chunked prefill, preemption.

    The Scheduler owns every request's fate: it alone moves a sequence between ``waiting``
    and ``running``, decides when and why it finished (``SequenceStatus.FINISHED_*``), and
    aborts it. Each call leaves the queues and the block manager consistent even when it
    raises part-way (the order of the updates is chosen for that; see ``postprocess``).
    """

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
        check_positive_int("max_num_seqs", max_num_seqs)
        check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if max_model_len is not None:
            check_positive_int("max_model_len", max_model_len)
        check_bool("enable_prefix_caching", enable_prefix_caching)
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
            eos = []
        elif is_int(eos_token_id):
            eos = [eos_token_id]
        else:
            eos = list(eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(check_token_ids("eos_token_id", eos))
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.preempted: list[Sequence] = []  # sent back to waiting by the latest schedule()
        self.finished: list[Sequence] = []   # finished, not yet handed over by postprocess()
        # Copy-on-write copies (src, dst) that the K/V owner must make before the next forward
        # pass (vLLM's blocks_to_copy). Kept until a step is recorded, so a failed step's
        # copies are made again.
        self.blocks_to_copy: list[tuple[int, int]] = []
        self.stats = SchedulerStats()

    # ---------------------------------------------------------------- requests

    def max_blocks_needed(self, seq: Sequence) -> int:
        """Blocks ``seq``'s request holds at its longest: every token but the last one generated
        is stored (the final token is sampled and returned, never fed back).

        With ``n`` completions, the full blocks of the prompt are shared by all of them and
        every completion holds the rest on its own.
        """
        final_len = seq.num_prompt_tokens + seq.max_tokens
        if self.max_model_len is not None:
            final_len = min(final_len, self.max_model_len)
        per_completion = (final_len - 1 + self.block_size - 1) // self.block_size
        shared = min(seq.num_prompt_tokens // self.block_size, per_completion)
        return shared + seq.sampling_params.n * (per_completion - shared)

    def add(self, seq: Sequence) -> None:
        """Queue a new request, or raise if it can never run (and queue nothing)."""
        self.add_all([seq])

    def add_all(self, seqs: list[Sequence]) -> None:
        """Queue several new requests in order: all of them, or -- if one is refused -- none."""
        seqs = list(seqs)
        for seq in seqs:
            self.check(seq)
        if len({id(s) for s in seqs}) != len(seqs):
            raise ValueError("the same sequence appears twice among the requests to add")
        for seq in seqs:
            seq.submitted = True
            self.waiting.append(seq)
            self.stats.prompt_tokens += seq.num_prompt_tokens

    def check(self, seq: Sequence) -> None:
        """Raise ``ValueError`` if ``seq`` cannot be added; change nothing either way.

        A sequence that needs more blocks than the whole pool would preempt itself forever,
        so it is refused here instead of looping in ``schedule``. A sequence is a request
        submitted once: one already added (here or to another scheduler) is refused.
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
        needed = self.max_blocks_needed(seq)
        if needed > self.block_manager.num_blocks:
            n = seq.sampling_params.n
            raise ValueError(
                f"sequence {seq.seq_id} can never fit in the KV cache: its prompt ({seq.num_prompt_tokens} "
                f"tokens) plus up to {seq.max_tokens} generated tokens"
                + (f" for each of {n} completions" if n > 1 else "")
                + f" need {needed} blocks of {self.block_size} tokens, the pool has "
                f"{self.block_manager.num_blocks}; use a larger pool, a shorter prompt or a smaller "
                + ("max_tokens or n" if n > 1 else "max_tokens"))

    def is_finished(self) -> bool:
        """No request waits or runs (finished ones may still wait to be handed over)."""
        return not self.waiting and not self.running

    def holds(self, seq: Sequence) -> bool:
        """Is ``seq`` waiting, running, or finished but not handed over yet?"""
        return any(s is seq for queue in (self.waiting, self.running, self.finished) for s in queue)

    def abort(self, seq: Sequence) -> None:
        """Finish ``seq`` as FINISHED_ABORTED wherever it is, releasing its blocks first.

        A request that already finished but was not handed over yet keeps its status; it is
        released and dropped from ``finished``. Raises ``ValueError`` for a sequence this
        scheduler does not hold.
        """
        if not self.holds(seq):
            raise ValueError(f"sequence {seq.seq_id} is not held by this scheduler "
                             f"(never added, or already finished and handed over)")
        if seq.block_table:
            self.block_manager.deallocate(seq)   # first: if it raises, nothing else changed
        seq.num_scheduled_tokens = 0
        if seq.is_finished:
            self.finished.remove(seq)
            return
        self._remove_from_queues(seq)
        seq.status = SequenceStatus.FINISHED_ABORTED

    def _remove_from_queues(self, seq: Sequence) -> None:
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)

    # ---------------------------------------------------------------- one step

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Choose the sequences of the next step: ``(seqs, is_prefill)``.

        Each chosen sequence has ``num_scheduled_tokens`` set: it computes tokens
        ``[num_cached_tokens, num_cached_tokens + num_scheduled_tokens)``. Sequences preempted
        on the way are listed in ``self.preempted``. The batch is empty only when no request
        waits or runs.
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
        if not self.waiting:
            return [], False  # nothing left to do
        # The decode step preempted every running sequence, the last one by releasing its own
        # blocks. (check() makes that impossible for this policy -- the oldest runner always
        # fits once the others are gone -- but a changed policy or block manager may do it.)
        # The pool is free again, so admission goes ahead in this same step.
        scheduled = self._schedule_prefill()
        if not scheduled:
            raise RuntimeError(f"nothing could be scheduled although {len(self.waiting)} requests "
                               "wait and none runs (check() admits only requests that fit in the pool)")
        self.stats.num_prefill_steps += 1
        return scheduled, True

    def _schedule_prefill(self) -> list[Sequence]:
        bm = self.block_manager
        scheduled: list[Sequence] = []
        num_batched_tokens = 0
        while self.waiting and num_batched_tokens < self.max_num_batched_tokens:
            seq = self.waiting[0]
            continuing = bool(seq.block_table)  # a chunked prompt from the last step
            if not continuing:
                # (admitted prompts are in running; a request of n completions takes n seats)
                if len(self.running) + seq.num_samples > self.max_num_seqs:
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
        # The running queue is walked in place (oldest first), never emptied and refilled,
        # so a failure part-way leaves every sequence where it was.
        i = 0
        while i < len(self.running) and len(scheduled) < self.max_num_batched_tokens:
            seq = self.running[i]
            while not bm.can_append(seq):
                victim = self.running[-1]   # the most recently admitted gives way
                self.preempt(victim)
                if victim is seq:           # it was the last one: it gave up its own blocks
                    break
            else:
                self.blocks_to_copy += bm.may_append(seq)   # copy-on-write of a shared last block
                seq.num_scheduled_tokens = seq.num_tokens - seq.num_cached_tokens  # == 1
                scheduled.append(seq)
                i += 1
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        """Free a running ``seq``'s blocks and put it first in line; it is recomputed on readmission."""
        self.block_manager.deallocate(seq)   # first: if it raises, nothing else changed
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.preempted.append(seq)
        self.stats.num_preemptions += 1

    def unschedule(self, seqs: list[Sequence]) -> None:
        """Undo ``schedule()`` for a step that will not be recorded (the model or the sampler
        raised): the sequences keep their blocks and compute the same tokens next time.

        A prompt that was moved to ``running`` without being computed goes back to the head
        of ``waiting``, where it continues like a chunked prompt.
        """
        back = []
        for seq in seqs:
            if seq.num_scheduled_tokens == 0:
                continue  # already recorded, finished or aborted
            seq.num_scheduled_tokens = 0
            if seq.status == SequenceStatus.RUNNING and seq.num_cached_tokens < seq.num_tokens - 1:
                back.append(seq)
        for seq in reversed(back):
            self.running.remove(seq)
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list, logprobs: list | None = None) -> list[Sequence]:
        """Record a step's results; return the sequences that finished (each exactly once).

        ``token_ids[i]`` is the token sampled for ``seqs[i]``, or None when that sequence
        computed only a chunk of its prompt (there is nothing to sample yet), or -- for the
        first sampled step of a request with ``n > 1`` completions -- a list of ``n`` tokens:
        the sequence then forks into ``n``, sharing all its blocks (``BlockManager.fork``).
        ``logprobs``, in the same shape, add to each sequence's ``cumulative_logprob``.

        The order makes a failure part-way harmless. The results are checked first, for the
        whole batch. Then plain bookkeeping that cannot fail: tokens counted as cached and
        appended, forks made, finished sequences taken out of ``running`` into ``finished``.
        Then the calls that may fail: ``hash_blocks`` (incremental, so a missed call is made up
        by the next one) and the release of the finished sequences' blocks (retried by the
        next call, which also hands over whatever this one could not).
        """
        self._check_step_results(seqs, token_ids)
        if logprobs is None:
            logprobs = [None if t is None else [0.0] * len(t) if isinstance(t, list) else 0.0 for t in token_ids]
        self.blocks_to_copy = []   # the step ran: its copies are made
        for seq, token_id, logprob in zip(seqs, token_ids, logprobs):
            # The step wrote the K/V of the scheduled tokens: they are cached now.
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if token_id is None:  # a chunk of a prompt: nothing to sample yet
                continue
            if isinstance(token_id, list):   # n completions: fork before they diverge
                group, tokens, lps = [seq] + self._fork(seq, len(token_id) - 1), token_id, logprob
            else:
                group, tokens, lps = [seq], [token_id], [logprob]
            for s, t, lp in zip(group, tokens, lps):
                s.append_token(t)
                s.cumulative_logprob += lp
                self.stats.generation_tokens += 1
                status = self._finish_status(s, t)
                if status is not None:
                    self.running.remove(s)
                    s.status = status
                    self.finished.append(s)
        # Offer the blocks the step completed to other sequences -- a finishing sequence's
        # too: its blocks stay cached after release, and a chat's next turn may reuse them.
        for seq in seqs:
            if seq.block_table:
                self.block_manager.hash_blocks(seq)
        for seq in self.finished:
            if seq.block_table:
                self.block_manager.deallocate(seq)
        finished, self.finished = self.finished, []
        return finished

    def _fork(self, seq: Sequence, num_children: int) -> list[Sequence]:
        """Completions 1 .. num_children of ``seq``'s request: forks sharing its blocks, placed
        right after it in ``running`` (a group is preempted from its newest member on)."""
        children = [seq.fork(j) for j in range(1, num_children + 1)]
        for child in children:
            self.block_manager.fork(seq, child)
        seq.children = children
        at = self.running.index(seq) + 1
        for j, child in enumerate(children):
            self.running.insert(at + j, child)
        return children

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
            n = seq.num_samples
            if n > 1 and token_id is not None:
                if not isinstance(token_id, list) or len(token_id) != n:
                    raise ValueError(f"sequence {seq.seq_id} samples its first tokens for {n} completions: "
                                     f"expected a list of {n} token ids, got {token_id!r}")
                tokens = token_id
            else:
                tokens = [] if token_id is None else [token_id]
            for t in tokens:
                if not is_int(t) or t < 0:
                    raise ValueError(f"sequence {seq.seq_id}: sampled token {t!r} is not a token id "
                                     f"(an integer >= 0)")
            completes = seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens
            if completes and token_id is None:
                raise ValueError(f"sequence {seq.seq_id} computed its last token but got no sampled token")
            if not completes and token_id is not None:
                raise ValueError(f"sequence {seq.seq_id} computed only a chunk of its prompt; "
                                 f"its token must be None, got {token_id!r}")

    def _finish_status(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        """Why ``seq`` finishes with ``token_id`` as its newest token, or None if it goes on."""
        if not seq.ignore_eos and token_id in self.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_completion_tokens >= seq.max_tokens:
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        if self.max_model_len is not None and seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        return None
